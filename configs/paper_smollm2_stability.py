r"""Stability on a real model (issue 40 item 4): SAO of
`configs/paper_smollm2.py` for 300 policy steps, and GRPO (no DIS) beside it
at the same staleness bound (2) for as long as it lasts.

Per step the run logs reward, value loss, entropy, the DIS-masked fraction
(1 - policy/accept_frac), |Δlogp| and staleness; held-out accuracy on the
same 256 problems every 25 policy steps. `python experiments/
paper_comparison.py` tabulates them by windows (`--window=25`). Seed 0, so
the first 40 steps pair with `configs/paper_smollm2_seeds.py`'s s0 points.

Run (resumable from its checkpoints every 10 steps; at low priority, over
several sessions if need be):

  nice -n 19 python experiments/sweep.py \
      --config=configs/paper_smollm2_stability.py \
      --workdir=runs/paper_smollm2_stability --parallel=1

then `python experiments/paper_comparison.py runs/paper_smollm2_stability
--out=experiments/results/paper_smollm2_stability --window=25`.
"""

from typing import Any

from configs import paper_smollm2

STEPS = 300
SEED = 0


def get_config():
  config = paper_smollm2.get_config()
  config.train.num_steps = STEPS
  config.train.eval_every = 25
  config.train.checkpoint_every = 10
  return config


def get_sweep() -> list[dict[str, Any]]:
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  return [{**arms[arm], "_name": f"{arm}_{STEPS}_s{SEED}", "train.seed": SEED,
           "env.seed": SEED} for arm in ("sao", "grpo")]
