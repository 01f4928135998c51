r"""Stability: SAO for 1,000 policy steps at CPU scale.

Batches of 16 trajectories (instead of 32) keep the run near 10 minutes on
2 cores; no token budget, the step count ends it.

  python experiments/sweep.py --config=configs/sao_long.py \
      --workdir=runs/sao_long
"""

import ml_collections

from configs import sao


def get_config() -> ml_collections.ConfigDict:
  config = sao.get_config()
  config.train.num_steps = 1000
  config.train.max_generated_tokens = 0
  config.train.batch_size = 16
  config.sampler.batch_size = 16
  config.train.eval_every = 100
  config.train.log_every = 10
  config.train.checkpoint_every = 100
  return config


def get_sweep():
  return sao.cpu_scale.seed_sweep((0,))
