r"""Staleness on a real model (issue 40 item 2): SAO, GRPO+DIS and GRPO of
`configs/paper_smollm2.py` at max staleness eta in {0, 4, 16}.

Every point sets `train.max_staleness = train.publish_lag = eta`: the sampler
acts with the weights of version v - eta while the trainer is at v, so its
trajectories are eta versions stale whatever the two processes' speeds
(`configs/staleness.py` does the same on the 0.9M-parameter toy). eta = 2 is
`configs/paper_smollm2_seeds.py`'s. Seed 0 at every eta, and seed 1 at
eta = 16, where the paper's claim (GRPO degrades, SAO and GRPO+DIS hold) is
decided; eta = 16 runs first.

Run (resumable, one point at a time at low priority):

  nice -n 19 python experiments/sweep.py \
      --config=configs/paper_smollm2_staleness.py \
      --workdir=runs/paper_smollm2_staleness --parallel=1

then `python experiments/paper_comparison.py runs/paper_smollm2_staleness
--out=experiments/results/paper_smollm2_staleness`.
"""

from typing import Any

from configs import paper_smollm2

ETAS = (16, 0, 4)  # The order they run in.
ARMS = ("sao", "grpo_dis", "grpo")
SECOND_SEED_ETAS = (16,)


def get_config():
  return paper_smollm2.get_config()


def get_sweep() -> list[dict[str, Any]]:
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  runs = [(eta, 0) for eta in ETAS] + [(eta, 1) for eta in SECOND_SEED_ETAS]
  return [{**arms[arm], "_name": f"{arm}_eta{eta}_s{seed}",
           "train.max_staleness": eta, "train.publish_lag": eta,
           "train.seed": seed, "env.seed": seed}
          for eta, seed in runs for arm in ARMS]
