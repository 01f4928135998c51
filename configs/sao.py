r"""SAO: one rollout per prompt, critic baseline (decoupled GAE), DIS (Eqs. 1-3).

  python experiments/sweep.py --config=configs/sao.py --workdir=runs/main/sao
"""

import ml_collections

from configs import cpu_scale


def get_config() -> ml_collections.ConfigDict:
  config = cpu_scale.get_config()
  config.rl.loss = "sao"
  config.rl.advantage = "decoupled_gae"
  return config


def get_sweep():
  return cpu_scale.seed_sweep()
