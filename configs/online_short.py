r"""Online-learning simulation with short phases (style switches at 25 and 50).

As configs/online.py, but the required style changes after 25 policy
versions instead of 60, before the first phase has driven the other styles'
probability to ~0: how fast each baseline adapts while the new style is still
sampled now and then.

  python experiments/sweep.py --config=configs/online_short.py \
      --workdir=runs/online_short
"""

import ml_collections

from configs import online


def get_config() -> ml_collections.ConfigDict:
  config = online.get_config()
  config.env.style_change_steps = (25, 50)
  config.train.num_steps = 100
  config.train.eval_every = 5
  return config


def get_sweep():
  return online.get_sweep()
