r"""Sweep points and their plan: names, directories, overrides, validation.

`experiments/sweep.py` runs the plan; this module decides it. A config file's
`get_sweep()` gives the points (dicts of dotted config keys); `load_points`
names them, `plan` resolves them against a sweep directory (finished,
unfinished or new; a shared SFT cache; every point's config validated before
anything runs) and `write_plan` writes `sweep.json` and each point's
`overrides.json`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import sys
from types import ModuleType
from typing import Any, Sequence

import ml_collections

from sao_jax import config_overrides
from sao_jax import config_validation

REPO = pathlib.Path(__file__).resolve().parents[1]
NAME_KEY = "_name"
DEFAULT_NAME = "run"
SFT_CACHE_KEY = "train.sft_cache_dir"
SUMMARY_FILE = "summary.json"
OVERRIDES_FILE = "overrides.json"
LOG_FILE = "log.txt"
SWEEP_FILE = "sweep.json"
_MAX_NAME_LEN = 100


class SweepError(ValueError):
  """The sweep cannot run as asked (bad sweep file, workdir conflict)."""



@dataclasses.dataclass(frozen=True)
class Point:
  """One sweep point: its directory name and flattened overrides."""
  name: str
  overrides: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class PlannedPoint:
  """A point resolved against a workdir.

  Attributes:
    name: the point's name (its directory under the workdir).
    overrides: what goes to its overrides.json (JSON types).
    dir: absolute path of the point's directory.
    status: 'finished' (summary.json exists: skip), 'unfinished' (directory
      exists: rerun, the trainer resumes) or 'new'.
  """
  name: str
  overrides: dict[str, Any]
  dir: pathlib.Path
  status: str

  @property
  def overrides_path(self) -> pathlib.Path:
    return self.dir / OVERRIDES_FILE

  @property
  def log_path(self) -> pathlib.Path:
    return self.dir / LOG_FILE



# ------------------------------------------------------------------ points ---


def load_module(config_path: str | os.PathLike[str]) -> ModuleType:
  """Runs a config file by path (`configs` importable from the repo).

  The file is compiled from its text every time, never from cached bytecode:
  the import system's cache is keyed on mtime (whole seconds) and size, so a
  file rewritten within a second at the same size would run its old code.
  """
  path = pathlib.Path(config_path).resolve()
  if not path.is_file():
    raise SweepError(f"--config={config_path}: file not found")
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
  module = ModuleType(f"sao_sweep_config_{digest}")
  module.__file__ = str(path)
  exec(compile(path.read_bytes(), str(path), "exec"), module.__dict__)  # pylint: disable=exec-used
  if not callable(getattr(module, "get_config", None)):
    raise SweepError(f"--config={config_path}: defines no get_config()")
  return module


def _format_value(value: Any) -> str:
  if isinstance(value, (list, tuple)):
    return "-".join(_format_value(v) for v in value)
  if isinstance(value, float):
    return repr(value)
  return str(value)


def _sanitize(name: str) -> str:
  """A safe directory name: [A-Za-z0-9._=,+-], no leading dot, bounded."""
  safe = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", name).lstrip(".")
  if len(safe) > _MAX_NAME_LEN:
    digest = hashlib.sha1(name.encode()).hexdigest()[:8]
    safe = f"{safe[:_MAX_NAME_LEN - 9]}-{digest}"
  return safe


def point_name(overrides: dict[str, Any]) -> str:
  """The directory name of a sweep point.

  `overrides["_name"]` if given (sanitized); else `key=value` items joined by
  ',' in the order of the dotted keys, each key shortened to its last
  component unless two keys of the point share it; `run` for no overrides.
  Characters outside [A-Za-z0-9._=,+-] become '_'.

  Args:
    overrides: the point's dict as `get_sweep()` returned it.

  Returns:
    The name.

  Raises:
    SweepError: if "_name" is not a non-empty string of safe characters.
  """
  if NAME_KEY in overrides:
    given = overrides[NAME_KEY]
    name = _sanitize(given) if isinstance(given, str) else ""
    if not name:
      raise SweepError(
          f"sweep point {overrides!r}: \"{NAME_KEY}\" must be a non-empty "
          f"string usable as a directory name, got {given!r}")
    return name
  items = sorted((k, v) for k, v in overrides.items())
  if not items:
    return DEFAULT_NAME
  last = collections.Counter(k.rpartition(".")[2] for k, _ in items)
  parts = []
  for key, value in items:
    short = key.rpartition(".")[2]
    label = short if last[short] == 1 else key
    parts.append(f"{label}={_format_value(value)}")
  return _sanitize(",".join(parts))


def _points_of(sweep: Any, where: str) -> list[Point]:
  if not isinstance(sweep, (list, tuple)) or not sweep:
    raise SweepError(
        f"{where}: get_sweep() must return a non-empty list of dicts, got "
        f"{sweep!r:.200}")
  points, seen = [], {}
  for i, item in enumerate(sweep):
    if isinstance(item, ml_collections.ConfigDict):
      item = item.to_dict()
    if not isinstance(item, dict) or not all(
        isinstance(k, str) and k for k in item):
      raise SweepError(
          f"{where}: get_sweep()[{i}] must be a dict of dotted config keys, "
          f"got {item!r:.200}")
    name = point_name(item)
    if name in seen:
      raise SweepError(
          f"{where}: sweep points {seen[name]} and {i} are both named "
          f"{name!r}; give them distinct \"{NAME_KEY}\" values")
    seen[name] = i
    points.append(Point(name, {k: v for k, v in item.items()
                               if k != NAME_KEY}))
  return points


def load_points(config_path: str | os.PathLike[str]) -> list[Point]:
  """The points of the config file's `get_sweep()` (one `run` without it)."""
  module = load_module(config_path)
  get_sweep = getattr(module, "get_sweep", None)
  if get_sweep is None:
    return [Point(DEFAULT_NAME, {})]
  return _points_of(get_sweep(), f"--config={config_path}")


def select(points: list[Point], only: str | Sequence[str] | None
            ) -> list[Point]:
  """The points named in `only` (names may hold commas: longest match)."""
  if not only:
    return points
  by_name = {p.name: p for p in points}
  if isinstance(only, str):
    tokens, names, i = only.split(","), [], 0
    while i < len(tokens):
      for j in range(len(tokens), i, -1):
        if ",".join(tokens[i:j]) in by_name:
          names.append(",".join(tokens[i:j]))
          i = j
          break
      else:
        raise SweepError(
            f"--only: no sweep point named {tokens[i]!r}; the points are "
            f"{', '.join(by_name)}")
  else:
    names = list(only)
    for name in names:
      if name not in by_name:
        raise SweepError(
            f"--only: no sweep point named {name!r}; the points are "
            f"{', '.join(by_name)}")
  return [p for p in points if p.name in names]


# -------------------------------------------------------------------- plan ---


def _json_roundtrip(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
  try:
    return json.loads(json.dumps(overrides))
  except (TypeError, ValueError) as e:
    raise SweepError(
        f"sweep point {name!r}: overrides must be JSON values (numbers, "
        f"strings, bools, None, lists): {e}") from None


def _read_json(path: pathlib.Path) -> Any:
  try:
    return json.loads(path.read_text())
  except (OSError, ValueError) as e:
    raise SweepError(
        f"{path}: unreadable ({e}); delete it or use a new --workdir") from None


def plan(config_path: str | os.PathLike[str], workdir: str | os.PathLike[str],
         points: list[Point], validate: bool = True,
         sft_cache_dir: str | os.PathLike[str] | None = None
         ) -> list[PlannedPoint]:
  """Resolves points against `workdir`; raises SweepError on conflicts.

  Adds `train.sft_cache_dir = sft_cache_dir` (default WORKDIR/sft_cache) to
  each point's overrides unless the config or the point sets it (and only
  where configs/base.py has the key). With `validate`, each point's config
  (config file + overrides) must pass `config_validation.validate_config`.

  Args:
    config_path: the sweep's config file.
    workdir: the sweep's directory.
    points: from `load_points` (possibly a subset).
    validate: check every point's full config before anything runs.
    sft_cache_dir: shared SFT cache (several sweeps may share one); default
      `workdir/sft_cache`.

  Returns:
    One PlannedPoint per point, in order.

  Raises:
    SweepError: `workdir/sweep.json` names another config; a point directory
      holds a run with other overrides; a point's config is invalid.
  """
  config_path = pathlib.Path(config_path).resolve()
  workdir = pathlib.Path(workdir).resolve()
  sweep_file = workdir / SWEEP_FILE
  if sweep_file.exists():
    previous = _read_json(sweep_file)
    old = previous.get("config") if isinstance(previous, dict) else None
    if old != str(config_path):
      raise SweepError(
          f"{sweep_file}: this workdir holds a sweep of config {old!r}, not "
          f"{str(config_path)!r}; use a new --workdir")
  module = load_module(config_path)
  base = config_validation.base_config()
  has_cache_key, _ = config_validation.get_path(base, SFT_CACHE_KEY)
  config_cache = ""
  if has_cache_key:
    _, config_cache = config_validation.get_path(module.get_config(),
                                                 SFT_CACHE_KEY)
  default_cache = str(pathlib.Path(sft_cache_dir).resolve() if sft_cache_dir
                      else workdir / "sft_cache")
  planned = []
  for point in points:
    overrides = _json_roundtrip(point.name, point.overrides)
    if has_cache_key and not config_cache and not overrides.get(SFT_CACHE_KEY):
      overrides[SFT_CACHE_KEY] = default_cache
    if validate:
      config = module.get_config()
      try:
        config_overrides.apply_overrides(config, overrides, base)
        config_validation.validate_config(config, base)
      except config_validation.ConfigError as e:
        raise SweepError(f"sweep point {point.name!r}: {e}") from None
    point_dir = workdir / point.name
    if (point_dir / SUMMARY_FILE).exists():
      status = "finished"
    elif point_dir.exists():
      status = "unfinished"
    else:
      status = "new"
    overrides_path = point_dir / OVERRIDES_FILE
    if overrides_path.exists():
      existing = _read_json(overrides_path)
      if existing != overrides:
        raise SweepError(
            f"sweep point {point.name!r}: {point_dir} holds a run with "
            f"overrides {json.dumps(existing, sort_keys=True)}, but the sweep "
            f"now gives {json.dumps(overrides, sort_keys=True)}; use a new "
            f"--workdir or delete {point_dir}")
    planned.append(PlannedPoint(point.name, overrides, point_dir, status))
  return planned


def _write_json(path: pathlib.Path, obj: Any) -> None:
  """Writes `obj` atomically (tmp file + rename)."""
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
  os.replace(tmp, path)


def write_plan(config_path: str | os.PathLike[str],
               workdir: str | os.PathLike[str], points: list[Point],
               planned: list[PlannedPoint]) -> None:
  """Writes WORKDIR/sweep.json (all points) and each planned overrides.json."""
  workdir = pathlib.Path(workdir).resolve()
  workdir.mkdir(parents=True, exist_ok=True)
  _write_json(workdir / SWEEP_FILE, {
      "config": str(pathlib.Path(config_path).resolve()),
      "points": [{"name": p.name, "overrides": _json_roundtrip(
          p.name, p.overrides)} for p in points],
  })
  for p in planned:
    p.dir.mkdir(exist_ok=True)
    if not p.overrides_path.exists():
      _write_json(p.overrides_path, p.overrides)
