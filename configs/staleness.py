r"""Staleness study: SAO and GRPO at max staleness eta in {0, 1, 4, 16}.

GRPO+DIS at eta in {4, 16} as well: GRPO's advantages with SAO's DIS loss,
which tells the DIS mask's share of the difference from the critic's.

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
DIS_ETAS = (4, 16)  # GRPO+DIS where GRPO degrades.


def get_config() -> ml_collections.ConfigDict:
  config = cpu_scale.get_config()
  config.rl.loss = "sao"
  config.rl.advantage = "decoupled_gae"
  return config


def get_sweep() -> list[dict[str, Any]]:
  grpo = {"rl.loss": "grpo", "rl.advantage": "group_zscore",
          "sampler.n_rollouts": 8, "rl.critic_warmup_steps": 0}
  grpo_dis = {**grpo, "rl.loss": "grpo_dis"}
  points = []
  for algo, extra, etas in (("sao", {}, ETAS), ("grpo", grpo, ETAS),
                            ("grpo_dis", grpo_dis, DIS_ETAS)):
    for eta in etas:
      points.append({"_name": f"{algo}_eta{eta}", **extra,
                     "train.max_staleness": eta, "train.publish_lag": eta})
  return points
