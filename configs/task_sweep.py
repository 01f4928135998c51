r"""Does RL lift held-out accuracy over the SFT warm start, task by task?

`configs/reasoning_gym.py` unchanged on eight reasoning-gym tasks of different
kinds, each at its dataset's default settings: every point overrides only
`env.dataset`, so each is exactly the generic command

  python -m sao_jax.main --config=configs/reasoning_gym.py --workdir=DIR \
      --config.env.dataset=NAME

Run (results: experiments/RESULTS.md §9):

  nice -n 10 python experiments/sweep.py --config=configs/task_sweep.py \
      --workdir=runs/task_sweep --parallel=2
"""

from typing import Any

import ml_collections

from configs import reasoning_gym

# (reasoning-gym dataset, kind of task).
TASKS = (
    ("spell_backward", "string manipulation"),
    ("syllogism", "logic"),
    ("letter_counting", "counting"),
    ("maze", "grid / graph search"),
    ("chain_sum", "arithmetic"),
    ("coin_flip", "probability"),
    ("count_bits", "counting (binary)"),
    ("simple_equations", "algebra"),
)


def get_config() -> ml_collections.ConfigDict:
  return reasoning_gym.get_config()


def get_sweep() -> list[dict[str, Any]]:
  return [{"_name": name, "env.dataset": name} for name, _ in TASKS]
