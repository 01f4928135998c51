r"""Staleness study: SAO and GRPO at max staleness eta in {0, 1, 4, 16}.

Every point runs the real asynchronous loop with `train.max_staleness = eta`
and the weight-publication holdback `train.publish_lag = eta`: the sampler
acts with the weights of version v - eta while the trainer is at v, so the
trajectories are eta versions stale whatever the relative speeds of the two
processes on 2 cores (eta = 0 is strict generate-then-train alternation).

  python experiments/sweep.py --config=configs/staleness.py \
      --workdir=runs/staleness
"""

from typing import Any

import ml_collections

from configs import cpu_scale

ETAS = (0, 1, 4, 16)


def get_config() -> ml_collections.ConfigDict:
  config = cpu_scale.get_config()
  config.rl.loss = "sao"
  config.rl.advantage = "decoupled_gae"
  return config


def get_sweep() -> list[dict[str, Any]]:
  grpo = {"rl.loss": "grpo", "rl.advantage": "group_zscore",
          "sampler.n_rollouts": 8, "rl.critic_warmup_steps": 0}
  points = []
  for algo, extra in (("sao", {}), ("grpo", grpo)):
    for eta in ETAS:
      points.append({"_name": f"{algo}_eta{eta}", **extra,
                     "train.max_staleness": eta, "train.publish_lag": eta})
  return points
