"""The key tree of an experiment config: `configs/base.py`'s keys and types.

A config may only hold keys that exist in the reference `configs/base.py`
(the free-form sections in `FREE_FORM` excepted), of the same types, and must
hold all of them. Every failure raises `ConfigError` whose message is one line
naming the key (config_validation checks the values).
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import pathlib
from typing import Any, Iterator

import ml_collections

# Sections whose keys are passed through unchecked (e.g. kwargs of
# reasoning_gym.create_dataset).
FREE_FORM = ("env.dataset_config", "env.chat_template_kwargs",
             "model.rope_scaling")

_BASE_CONFIG = (pathlib.Path(__file__).resolve().parents[1] / "configs" /
                "base.py")


class ConfigError(ValueError):
  """A config key is unknown, mistyped, out of range or inconsistent."""


def base_config(path: str | os.PathLike[str] | None = None
                ) -> ml_collections.ConfigDict:
  """Loads `get_config()` of `configs/base.py` (the reference key tree)."""
  path = pathlib.Path(path or _BASE_CONFIG)
  if not path.is_file():
    raise FileNotFoundError(
        f"base config {path} not found; run from a sao_jax checkout or pass "
        "its path.")
  spec = importlib.util.spec_from_file_location("sao_jax_base_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def leaf_paths(cfg: Any, prefix: str = "") -> Iterator[str]:
  for key, value in cfg.items():
    path = f"{prefix}{key}"
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      yield from leaf_paths(value, path + ".")
    else:
      yield path


def _unknown_key_error(path: str, siblings: list[str],
                       base: Any) -> ConfigError:
  parent, _, key = path.rpartition(".")
  close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
  if close:
    hint = f"; did you mean config.{parent + '.' if parent else ''}{close[0]}?"
  else:
    elsewhere = [p for p in leaf_paths(base) if p.rpartition(".")[2] == key]
    if elsewhere:
      hint = f"; did you mean config.{elsewhere[0]}?"
    else:
      known = ", ".join(sorted(siblings))
      hint = f"; known keys here: {known}"
  return ConfigError(f"config.{path}: unknown key{hint}")


def check_key_path(path: str, base: ml_collections.ConfigDict | None = None
                   ) -> None:
  """Raises ConfigError if the dotted `path` (e.g. 'rl.eps_low') is unknown."""
  base = base_config() if base is None else base
  node, done = base, []
  for part in path.split("."):
    if ".".join(done) in FREE_FORM:
      return
    if not isinstance(node, (ml_collections.ConfigDict, dict)):
      raise ConfigError(
          f"config.{'.'.join(done)}: is a {type(node).__name__} value, it has "
          f"no key {part!r}")
    if part not in node:
      raise _unknown_key_error(".".join(done + [part]), list(node.keys()), base)
    node = node[part]
    done.append(part)


def get_path(config: Any, path: str) -> tuple[bool, Any]:
  """(True, value) at the dotted `path` of `config`, or (False, None)."""
  node = config
  for part in path.split("."):
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or (
        part not in node):
      return False, None
    node = node[part]
  return True, node


def _type_name(t: type) -> str:
  return {ml_collections.ConfigDict: "config section"}.get(t, t.__name__)


def _check_type(path: str, value: Any, base_parent: Any, key: str) -> None:
  """`value` must have the type of the base field (int allowed for float)."""
  ref = base_parent.get_ref(key) if hasattr(base_parent, "get_ref") else None
  want = ref.get_type() if ref is not None else type(base_parent[key])
  base_value = base_parent[key]
  if value is None:
    if base_value is None:
      return  # Optional (placeholder) field.
    raise ConfigError(f"config.{path}: expected {_type_name(want)}, got None")
  ok = {
      float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
      int: lambda v: isinstance(v, int) and not isinstance(v, bool),
      tuple: lambda v: isinstance(v, (tuple, list)),
      list: lambda v: isinstance(v, (tuple, list)),
  }.get(want, lambda v: isinstance(v, want))
  if not ok(value):
    raise ConfigError(
        f"config.{path}: expected {_type_name(want)}, got "
        f"{type(value).__name__} {value!r}")
  # Homogeneous tuples of scalars (dataset names, step lists) keep their
  # element type.
  if want is tuple and base_value:
    elem = {type(x) for x in base_value}
    if len(elem) == 1 and next(iter(elem)) in (int, float, str):
      (etype,) = elem
      for i, x in enumerate(value):
        if not isinstance(x, etype) or isinstance(x, bool):
          raise ConfigError(
              f"config.{path}[{i}]: expected {etype.__name__}, got "
              f"{type(x).__name__} {x!r}")


def check_keys_and_types(config: Any, base: Any, prefix: str = "",
                         root: Any = None) -> None:
  """Every key of `config` exists in `base` with a compatible type.

  Args:
    config: (a section of) the config to check.
    base: the matching section of the reference config.
    prefix: dotted path of the section, '' at the top.
    root: the whole reference config (for suggestions across sections).
  """
  root = base if root is None else root
  for key, value in config.items():
    path = f"{prefix}{key}"
    if key not in base:
      raise _unknown_key_error(path, list(base.keys()), root)
    base_value = base[key]
    if isinstance(base_value, ml_collections.ConfigDict):
      if not isinstance(value, (ml_collections.ConfigDict, dict)):
        raise ConfigError(
            f"config.{path}: expected a config section, got "
            f"{type(value).__name__} {value!r}")
      if path not in FREE_FORM:
        check_keys_and_types(value, base_value, path + ".", root)
    else:
      _check_type(path, value, base, key)


def check_key_tree(config: Any, base: Any) -> None:
  """`config` has exactly `base`'s keys (free-form sections aside), each of
  its type."""
  check_keys_and_types(config, base)
  missing = [p for p in leaf_paths(base) if not get_path(config, p)[0]
             and not any(p.startswith(f + ".") for f in FREE_FORM)]
  if missing:
    raise ConfigError(
        f"config.{missing[0]}: missing (start the config from configs/base.py"
        f" get_config())")
