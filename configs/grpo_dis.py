r"""GRPO+DIS: GRPO's 8-rollout group z-score advantages with SAO's DIS loss.

  python experiments/sweep.py --config=configs/grpo_dis.py \
      --workdir=runs/main/grpo_dis
"""

import ml_collections

from configs import cpu_scale


def get_config() -> ml_collections.ConfigDict:
  config = cpu_scale.get_config()
  config.rl.loss = "grpo_dis"  # DIS band 0.3 / 5.0 (registry default).
  cpu_scale.grpo_overrides(config)
  return config


def get_sweep():
  return cpu_scale.seed_sweep()
