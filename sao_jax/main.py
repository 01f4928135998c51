r"""Entry point: validate an experiment config, then train.

  python -m sao_jax.main --config=configs/base.py --workdir=/tmp/sao \
      --config.rl.eps_low=0.2 --config.train.mode=sync

`--overrides=PATH.json` applies a JSON object of dotted keys
({"rl.loss": "grpo", "train.seed": 1}) after the config file and the
`--config.x=...` flags; experiments/sweep.py uses it for each sweep point.

A bad config (unknown key, wrong type, out of range, inconsistent) stops the
run before any compute with a one-line message naming the key.
"""

from __future__ import annotations

import importlib
import logging as py_logging
import sys
from typing import Sequence

from absl import app
from absl import flags
from absl import logging
import jax
from ml_collections import config_flags

from sao_jax import config_overrides
from sao_jax import config_validation
from sao_jax import sharding
from sao_jax.envs import task_sizing
from sao_jax.sampler import devices as sampler_devices

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config file (e.g. configs/base.py).",
    lock_config=False, accept_new_attributes=True)
_WORKDIR = flags.DEFINE_string(
    "workdir", None,
    "Directory for checkpoints, TensorBoard events and the tokenizer.")
_OVERRIDES = flags.DEFINE_string(
    "overrides", None,
    "JSON file with an object of dotted config keys to values, applied after "
    "--config and the --config.x=... flags (e.g. {\"rl.eps_low\": 0.2}).")
flags.mark_flags_as_required(["config", "workdir"])



def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl flag parsing that reports a bad flag value in one line and exits.

  The config is loaded unlocked: ``env.dataset_config`` is free-form (any
  ``reasoning_gym`` dataset keyword may be added from the command line), and
  ml_collections accepts new keys only in an unlocked config. A mistyped key
  therefore arrives as a new key, which ``validate_config`` rejects naming the
  closest known one; ``main`` locks the config once it is valid. (Why it is
  not loaded locked with ``env.dataset_config`` left open: docs/design/layout.md
  "Configuration".)
  """
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:  # E.g. a value that does not parse as the type.
    sys.exit(f"{e}".splitlines()[0])


class _DropLibraryInfo(py_logging.Filter):
  """Keeps INFO lines of sao_jax; drops other libraries' INFO chatter (orbax
  logs a dozen lines per checkpoint). Warnings and errors always pass."""

  def filter(self, record: py_logging.LogRecord) -> bool:
    return (record.levelno >= py_logging.WARNING
            or "/sao_jax/" in record.pathname.replace("\\", "/"))


def _print_summary(summary: dict[str, float], workdir: str) -> None:
  """The run's closing table on stdout (this is the CLI, not library code)."""
  import rich.console  # pylint: disable=g-import-not-at-top
  import rich.table  # pylint: disable=g-import-not-at-top

  table = rich.table.Table(title=f"sao_jax run summary ({workdir})")
  table.add_column("metric")
  table.add_column("value", justify="right")
  for key, value in summary.items():
    shown = f"{value:.4g}" if isinstance(value, float) else str(value)
    table.add_row(key, shown)
  rich.console.Console().print(table)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  try:
    if _OVERRIDES.value:
      config_overrides.apply_overrides(
          config, config_overrides.load_overrides(_OVERRIDES.value))
    config_validation.validate_config(config)
  except config_validation.ConfigError as e:
    sys.exit(str(e))
  config.lock()  # Later typos (config.x = ...) fail instead of adding keys.
  # Join the other hosts before anything touches a device, then check the
  # mesh against the global device count.
  sampler_devices.apply(str(config.sampler.chips), "trainer")
  sharding.initialize_distributed(config.distributed)
  try:
    config_validation.validate_mesh(config, jax.device_count())
  except config_validation.ConfigError as e:
    sys.exit(str(e))
  logging.info("Config:\n%s", config)
  try:
    loop = importlib.import_module("sao_jax.train.loop")
  except ModuleNotFoundError as e:
    if e.name not in ("sao_jax.train.loop", "sao_jax.train"):
      raise
    sys.exit("The trainer is not available: sao_jax.train.loop (with "
             "train_and_evaluate(config, workdir)) is missing from this "
             "installation.")
  logging.get_absl_handler().addFilter(_DropLibraryInfo())
  try:
    summary = loop.train_and_evaluate(config, _WORKDIR.value)
  except task_sizing.SizingError as e:  # A setting that does not fit the task.
    sys.exit(str(e))
  except loop.workdir_lock.WorkdirInUseError as e:  # Another run holds it.
    sys.exit(str(e))
  _print_summary(summary, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
