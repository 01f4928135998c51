"""Config overrides from JSON files: `--overrides=PATH.json` and sweep points.

A JSON object of dotted keys (``{"rl.loss": "grpo", "train.seed": 1}``) is
checked key by key against `configs/base.py` (`config_validation`) and set on
the config; `experiments/sweep.py` writes one such file per sweep point.
"""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

from sao_jax.config_validation import base_config
from sao_jax.config_validation import check_key_path
from sao_jax.config_validation import ConfigError
from sao_jax.config_validation import get_path


def _to_tuples(value: Any) -> Any:
  """JSON lists (nested too) as tuples."""
  if isinstance(value, (list, tuple)):
    return tuple(_to_tuples(v) for v in value)
  return value


def load_overrides(path: str | os.PathLike[str]) -> dict[str, Any]:
  """Reads a JSON object of flattened overrides ({"rl.eps_low": 0.2, ...}).

  Raises:
    ConfigError: (one line, naming the file) if the file is missing, is not
      valid JSON or is not an object whose keys are dotted config paths.
  """
  try:
    with open(path, encoding="utf-8") as f:
      overrides = json.load(f)
  except FileNotFoundError:
    raise ConfigError(
        f"--overrides={path}: file not found; pass the path of a JSON object "
        'of dotted config keys, e.g. {"rl.eps_low": 0.2}') from None
  except OSError as e:
    raise ConfigError(f"--overrides={path}: cannot read it ({e})") from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ConfigError(
        f"--overrides={path}: not valid JSON ({e}); expected an object of "
        'dotted config keys, e.g. {"rl.eps_low": 0.2}') from None
  if not isinstance(overrides, dict):
    raise ConfigError(
        f"--overrides={path}: expected a JSON object of dotted config keys, "
        f"got a JSON {type(overrides).__name__}")
  return overrides


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: dict[str, Any],
                    base: ml_collections.ConfigDict | None = None) -> None:
  """Sets flattened `overrides` ({"rl.eps_low": 0.2}) on `config` in place.

  Each key must exist in `base` (default `configs/base.py`; keys under the
  `FREE_FORM` sections may be new). A JSON list becomes a tuple where the
  config's current value is a tuple. Types and ranges are left to
  `validate_config`, except what ConfigDict itself refuses (e.g. a float for
  an int field).

  Raises:
    ConfigError: (one line, naming the key) for an unknown key or a value the
      field cannot hold.
  """
  base = base_config() if base is None else base
  for key, value in overrides.items():
    if not isinstance(key, str) or not key:
      raise ConfigError(f"overrides: expected dotted config keys, got {key!r}")
    check_key_path(key, base)
    found, current = get_path(config, key)
    if found and isinstance(current, tuple) and isinstance(value, list):
      value = _to_tuples(value)
    try:
      config.update_from_flattened_dict({key: value})
    except (KeyError, TypeError, ValueError, AttributeError) as e:
      reason = str(e).strip().splitlines()[0] if str(e).strip() else type(
          e).__name__
      raise ConfigError(
          f"config.{key}: cannot set {value!r} ({reason})") from None
