r"""VAPO: critic with length-adaptive GAE (alpha = 0.05), clip-higher PPO, no DIS.

  python experiments/sweep.py --config=configs/vapo.py \
      --workdir=runs/ablations/vapo
"""

import ml_collections

from configs import cpu_scale


def get_config() -> ml_collections.ConfigDict:
  config = cpu_scale.get_config()
  config.rl.loss = "vapo"  # Token-mean PPO clip 0.2 / 0.28 (registry).
  config.rl.advantage = "vapo_gae"  # lambda_policy = 1 - 1/(0.05 l).
  return config


def get_sweep():
  return cpu_scale.seed_sweep((0,))
