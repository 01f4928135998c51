r"""The paper's main comparison with seeds (issue 40 item 1): SAO, GRPO+DIS
and GRPO of `configs/paper_smollm2.py`, each with 3 seeds.

A seed sets both `train.seed` (the value head's init, sampling) and
`env.seed` (the order and draw of the training problems), so the three arms
of one seed see the same problems; every arm answers the same 256 held-out
problems (`env.eval_seed`), so accuracy differences are paired.

Run (resumable: finished points are skipped, unfinished ones resume from
their checkpoints; one point at a time at low priority):

  nice -n 19 python experiments/sweep.py \
      --config=configs/paper_smollm2_seeds.py \
      --workdir=runs/paper_smollm2_seeds --parallel=1

then `python experiments/paper_comparison.py runs/paper_smollm2_seeds
--out=experiments/results/paper_smollm2_seeds`.
"""

from typing import Any

from configs import paper_smollm2

SEEDS = (0, 1, 2)
ARMS = ("sao", "grpo_dis", "grpo")


def get_config():
  return paper_smollm2.get_config()


def get_sweep() -> list[dict[str, Any]]:
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  return [{**arms[arm], "_name": f"{arm}_s{seed}", "train.seed": seed,
           "env.seed": seed}
          for seed in SEEDS for arm in ARMS]
