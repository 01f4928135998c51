r"""Ablation: SAO without frozen attention (the critic trains all its weights).

  python experiments/sweep.py --config=configs/sao_no_frozen_attention.py \
      --workdir=runs/ablations/sao_no_frozen_attention
"""

import ml_collections

from configs import sao


def get_config() -> ml_collections.ConfigDict:
  config = sao.get_config()
  config.rl.critic_frozen_attention = False
  return config


def get_sweep():
  return sao.cpu_scale.seed_sweep((0,))
