"""Shared setup of the benchmarks that time the real training loop.

``async_vs_sync.py`` and ``record.py`` run ``loop.train_and_evaluate`` on the
quickstart's model and task with everything around the RL steps switched off;
``loop_config`` is that config, ``emit`` prints one figure as a JSON line with
the machine's load.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections


# The batch-synchronous sampler: a batch leaves when its last episode ends,
# weights change only between batches (the benchmarks' baseline arm).
BATCH_SAMPLER = {"sampler.refill": False, "sampler.weight_poll_tokens": 0}


def loop_config(num_steps: int,
                overrides: dict[str, Any] | None = None,
                base: str = "quickstart") -> ml_collections.ConfigDict:
  """``configs/<base>.py``'s model and task (the quickstart's by default): no
  SFT, evaluation, checkpoints or critic warm-up, ``num_steps`` policy steps;
  ``overrides`` are dotted keys (``{"train.mode": "sync"}``) checked against
  ``configs/base.py``."""
  # pylint: disable=g-import-not-at-top
  import importlib
  from sao_jax import config_overrides
  # pylint: enable=g-import-not-at-top

  config = importlib.import_module(f"configs.{base}").get_config()
  config.train.num_steps = num_steps
  config.train.sft_steps = 0
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  config.env.eval_size = 8
  config.rl.critic_warmup_steps = 0
  config_overrides.apply_overrides(config, overrides or {})
  return config


def emit(figure: str, **values: Any) -> None:
  """Prints one figure as a JSON line with the 1-minute load average."""
  print(json.dumps({"figure": figure, **values,
                    "loadavg_1m": round(os.getloadavg()[0], 2)}))
