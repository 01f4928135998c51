r"""GRPO: 8 rollouts per prompt, group z-score advantages, clip-higher 0.2/0.28.

pi_old is the trainer's own snapshot (one update per batch), so stale
trajectories are not corrected; no DIS. Same token budget as SAO.

  python experiments/sweep.py --config=configs/grpo.py --workdir=runs/main/grpo
"""

import ml_collections

from configs import cpu_scale


def get_config() -> ml_collections.ConfigDict:
  config = cpu_scale.get_config()
  config.rl.loss = "grpo"  # Registry defaults: eps 0.2 / 0.28, no KL.
  cpu_scale.grpo_overrides(config)
  return config


def get_sweep():
  return cpu_scale.seed_sweep()
