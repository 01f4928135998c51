"""Shared setup of the benchmarks that time the real training loop.

``async_vs_sync.py`` and ``record.py`` run ``loop.train_and_evaluate`` on the
quickstart's model and task with everything around the RL steps switched off;
``loop_config`` is that config, ``emit`` prints one figure as a JSON line with
the machine's load.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys
from types import ModuleType
from typing import Any

import ml_collections

# The checkout's root: ``configs`` is a package there, not an installed one.
REPO = pathlib.Path(__file__).resolve().parents[2]


def import_config(name: str) -> ModuleType:
  """``configs/<name>.py`` as the module ``configs.<name>`` (the checkout's
  root goes on ``sys.path``: a script's own folder is what Python puts there,
  and ``configs/`` is not installed)."""
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  return importlib.import_module(f"configs.{name}")


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
  from sao_jax import config_overrides  # pylint: disable=g-import-not-at-top

  config = import_config(base).get_config()
  config.train.num_steps = num_steps
  config.train.sft_steps = 0
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  config.env.eval_size = 8
  config.rl.critic_warmup_steps = 0
  config_overrides.apply_overrides(config, overrides or {})
  return config


def parse_sets(items: list[str]) -> dict[str, Any]:
  """``--set KEY=VALUE`` items as overrides (``VALUE`` read as JSON, else as a
  string): ``["model.num_layers=2"]`` -> ``{"model.num_layers": 2}``."""
  overrides = {}
  for item in items:
    key, _, value = item.partition("=")
    if not key or not value:
      raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. "
                       "model.num_layers=2")
    try:
      overrides[key] = json.loads(value)
    except json.JSONDecodeError:
      overrides[key] = value
  return overrides


def emit(figure: str, **values: Any) -> None:
  """Prints one figure as a JSON line with the 1-minute load average."""
  print(json.dumps({"figure": figure, **values,
                    "loadavg_1m": round(os.getloadavg()[0], 2)}))
