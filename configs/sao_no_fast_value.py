r"""Ablation: SAO without faster value updates (1 critic step per policy step).

  python experiments/sweep.py --config=configs/sao_no_fast_value.py \
      --workdir=runs/ablations/sao_no_fast_value
"""

import ml_collections

from configs import sao


def get_config() -> ml_collections.ConfigDict:
  config = sao.get_config()
  config.rl.critic_updates_per_step = 1
  return config


def get_sweep():
  return sao.cpu_scale.seed_sweep((0,))
