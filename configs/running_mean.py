r"""Running-mean baseline: DIS with A = r - mean(last 8 rewards of the prompt).

No critic: the advantage needs none, so the step trains none.

  python experiments/sweep.py --config=configs/running_mean.py \
      --workdir=runs/ablations/running_mean
"""

import ml_collections

from configs import cpu_scale


def get_config() -> ml_collections.ConfigDict:
  config = cpu_scale.get_config()
  config.rl.loss = "sao"
  config.rl.advantage = "running_mean"
  config.rl.running_mean_k = 8
  config.rl.running_mean_scope = "prompt"
  config.rl.critic_warmup_steps = 0
  return config


def get_sweep():
  return cpu_scale.seed_sweep((0,))
