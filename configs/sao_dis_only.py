r"""Ablation: SAO with DIS only, none of the critic designs.

Plain GAE (lambda = rl.lam_critic for advantages too, no length-adaptive
policy lambda), one critic update per step (no faster value updates), the
whole critic trained (no frozen attention) and no critic warm-up.

  python experiments/sweep.py --config=configs/sao_dis_only.py \
      --workdir=runs/ablations/sao_dis_only
"""

import ml_collections

from configs import cpu_scale


def get_config() -> ml_collections.ConfigDict:
  config = cpu_scale.get_config()
  config.rl.loss = "sao"
  config.rl.advantage = "gae"
  config.rl.critic_updates_per_step = 1
  config.rl.critic_frozen_attention = False
  config.rl.critic_warmup_steps = 0
  return config


def get_sweep():
  return cpu_scale.seed_sweep((0,))
