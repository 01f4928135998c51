r"""Runs every point of a config's sweep, each as its own training run.

A config file may define `get_sweep()` returning a list of dicts of dotted
config keys (ml_collections flattened overrides), e.g.

  def get_sweep():
    return [{"train.seed": s, "rl.loss": l}
            for s in (0, 1) for l in ("sao", "grpo")]

Each point runs as `python -m sao_jax.main --config=CONFIG --workdir=DIR/NAME
--overrides=DIR/NAME/overrides.json` (output in DIR/NAME/log.txt), N at a
time. The optional key "_name" names a point; otherwise the name is built from
its items (`loss=grpo,seed=0`). A config without `get_sweep` is one point
named `run`.

  python experiments/sweep.py --config=configs/sao.py --workdir=/tmp/sweep \
      --parallel=2 [--only=seed=0,seed=1] [--dry_run]

Rerunning skips finished points (DIR/NAME/summary.json exists) and reruns
unfinished ones (the trainer resumes from DIR/NAME/checkpoints). Points share
one SFT warm start through `train.sft_cache_dir` (DIR/sft_cache) unless the
config or the point sets it. Prints one JSON line per point as it ends; exits 1
if a point failed, listing their logs.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time
from types import ModuleType
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
from absl import logging
import ml_collections

from sao_jax import config_overrides
from sao_jax import config_validation

FLAGS = flags.FLAGS
REPO = pathlib.Path(__file__).resolve().parents[1]
NAME_KEY = "_name"
DEFAULT_NAME = "run"
SFT_CACHE_KEY = "train.sft_cache_dir"
SUMMARY_FILE = "summary.json"
OVERRIDES_FILE = "overrides.json"
LOG_FILE = "log.txt"
SWEEP_FILE = "sweep.json"
_MAX_NAME_LEN = 100
_ATTEMPT_HEADER = "===== sweep attempt "

# (config path, point dir, overrides.json path) -> the command to run.
CommandFn = Callable[[str, str, str], list[str]]


class SweepError(ValueError):
  """The sweep cannot run as asked (bad sweep file, workdir conflict)."""


class Terminated(Exception):
  """SIGTERM arrived (raised by the CLI's signal handler)."""


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


def _load_module(config_path: str | os.PathLike[str]) -> ModuleType:
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
  module = _load_module(config_path)
  get_sweep = getattr(module, "get_sweep", None)
  if get_sweep is None:
    return [Point(DEFAULT_NAME, {})]
  return _points_of(get_sweep(), f"--config={config_path}")


def _select(points: list[Point], only: str | Sequence[str] | None
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
  module = _load_module(config_path)
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


# --------------------------------------------------------------------- run ---


def main_command(config_path: str, point_dir: str,
                 overrides_path: str) -> list[str]:
  """The trainer command of one point."""
  return [sys.executable, "-m", "sao_jax.main", f"--config={config_path}",
          f"--workdir={point_dir}", f"--overrides={overrides_path}"]


@dataclasses.dataclass
class _Running:
  point: PlannedPoint
  proc: subprocess.Popen
  start: float
  log: Any


def _emit(point: PlannedPoint, status: str, wall_s: float) -> dict[str, Any]:
  record = {"point": point.name, "status": status,
            "wall_s": round(wall_s, 3), "log": str(point.log_path)}
  print(json.dumps(record), flush=True)
  return record


def _start(point: PlannedPoint, config_path: str,
           command_fn: CommandFn) -> _Running:
  cmd = command_fn(config_path, str(point.dir), str(point.overrides_path))
  previous = 0
  if point.log_path.exists():
    previous = point.log_path.read_bytes().count(_ATTEMPT_HEADER.encode())
  log = open(point.log_path, "a", encoding="utf-8")
  stamp = datetime.datetime.now().isoformat(timespec="seconds")
  log.write(f"{_ATTEMPT_HEADER}{previous + 1} ({stamp}, {point.status}) "
            f"=====\n$ {shlex.join(cmd)}\n")
  log.flush()
  logging.info("Starting point %s (attempt %d): %s", point.name, previous + 1,
               point.log_path)
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL)
  return _Running(point, proc, time.monotonic(), log)


def _terminate(running: dict[str, _Running], grace_s: float) -> None:
  """SIGTERM to every child; SIGKILL to those alive after `grace_s`."""
  for r in running.values():
    if r.proc.poll() is None:
      logging.warning("Terminating point %s (pid %d)", r.point.name,
                      r.proc.pid)
      r.proc.terminate()
  deadline = time.monotonic() + grace_s
  for r in running.values():
    try:
      r.proc.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      logging.warning("Point %s ignored SIGTERM for %.0f s; killing it",
                      r.point.name, grace_s)
      r.proc.kill()
      r.proc.wait()
    r.log.close()


def run_sweep(config_path: str | os.PathLike[str],
              workdir: str | os.PathLike[str], parallel: int = 1,
              only: str | Sequence[str] | None = None, dry_run: bool = False,
              command_fn: CommandFn = main_command, poll_s: float = 0.1,
              grace_s: float = 60.0,
              sft_cache_dir: str | os.PathLike[str] | None = None
              ) -> list[dict[str, Any]]:
  """Runs the sweep's unfinished points, `parallel` at a time.

  Args:
    config_path: config file (with or without `get_sweep()`).
    workdir: the sweep's directory; point NAME runs in `workdir/NAME`.
    parallel: points running at once.
    only: names of the points to consider (a comma-separated string or a
      list); default all.
    dry_run: print the plan (one JSON line per point) and run nothing.
    command_fn: builds a point's command (default: sao_jax.main).
    poll_s: seconds between checks of the running children.
    grace_s: on interruption, seconds children get to exit after SIGTERM.
    sft_cache_dir: shared SFT cache directory (default `workdir/sft_cache`).

  Returns:
    One record per point ({"point", "status", "wall_s", "log"}, status
    'finished', 'skipped' or 'failed'), in the order they ended; in a dry run,
    the plan records.

  Raises:
    SweepError: the sweep cannot start (see `plan`).
  """
  if parallel < 1:
    raise SweepError(f"--parallel: expected an int >= 1, got {parallel}")
  config_path = str(pathlib.Path(config_path).resolve())
  workdir = pathlib.Path(workdir).resolve()
  points = load_points(config_path)
  selected = _select(points, only)
  planned = plan(config_path, workdir, selected,
                 sft_cache_dir=sft_cache_dir)
  if dry_run:
    records = []
    for p in planned:
      record = {"point": p.name,
                "plan": "skip" if p.status == "finished" else (
                    "resume" if p.status == "unfinished" else "run"),
                "dir": str(p.dir), "overrides": p.overrides,
                "command": command_fn(config_path, str(p.dir),
                                      str(p.overrides_path))}
      print(json.dumps(record), flush=True)
      records.append(record)
    return records
  write_plan(config_path, workdir, points, planned)
  logging.info("Sweep of %s in %s: %d points (%d finished), %d at a time",
               config_path, workdir, len(planned),
               sum(p.status == "finished" for p in planned), parallel)
  records = []
  pending = collections.deque()
  for p in planned:
    if p.status == "finished":
      logging.info("Point %s is finished (%s exists); skipping", p.name,
                   p.dir / SUMMARY_FILE)
      records.append(_emit(p, "skipped", 0.0))
    else:
      pending.append(p)
  running: dict[str, _Running] = {}
  try:
    while pending or running:
      while pending and len(running) < parallel:
        p = pending.popleft()
        running[p.name] = _start(p, config_path, command_fn)
      for name, r in list(running.items()):
        rc = r.proc.poll()
        if rc is None:
          continue
        del running[name]
        r.log.close()
        wall_s = time.monotonic() - r.start
        if rc == 0 and (r.point.dir / SUMMARY_FILE).exists():
          logging.info("Point %s finished in %.1f s", name, wall_s)
          records.append(_emit(r.point, "finished", wall_s))
        else:
          why = (f"exit status {rc}" if rc else
                 f"exit status 0 without writing {SUMMARY_FILE}")
          logging.error("Point %s failed (%s) after %.1f s; see %s", name,
                        why, wall_s, r.point.log_path)
          records.append(_emit(r.point, "failed", wall_s))
      if running:
        time.sleep(poll_s)
  except BaseException:  # Ctrl-C, SIGTERM: stop the children first.
    _terminate(running, grace_s)
    raise
  return records


def failure_message(records: list[dict[str, Any]]) -> str | None:
  """The CLI's exit message if a point failed (names and logs), else None."""
  failed = [r for r in records if r.get("status") == "failed"]
  if not failed:
    return None
  lines = [f"{len(failed)} of {len(records)} sweep points failed:"]
  lines += [f"  {r['point']}: {r['log']}" for r in failed]
  return "\n".join(lines)


# --------------------------------------------------------------------- CLI ---


def define_flags() -> None:
  """The CLI's flags (defined when run as a script only, so that importing
  this module next to sao_jax.main, which has --config too, is possible)."""
  flags.DEFINE_string(
      "config", None,
      "Config file, e.g. configs/sao.py (may define get_sweep).")
  flags.DEFINE_string(
      "workdir", None, "Sweep directory; point NAME runs in WORKDIR/NAME.")
  flags.DEFINE_integer("parallel", 1, "Points running at once.")
  flags.DEFINE_string(
      "only", None,
      "Comma-separated names of the points to run (default all).")
  flags.DEFINE_string(
      "sft_cache_dir", None,
      "Directory for shared SFT warm starts (default WORKDIR/sft_cache); give "
      "several sweeps the same one to train the warm start once.")
  flags.DEFINE_bool(
      "dry_run", False, "Print the plan and commands; run and write nothing.")
  flags.mark_flags_as_required(["config", "workdir"])


def _raise_terminated(signum, frame) -> None:
  del signum, frame
  raise Terminated()


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  signal.signal(signal.SIGTERM, _raise_terminated)
  try:
    records = run_sweep(FLAGS.config, FLAGS.workdir, FLAGS.parallel,
                        only=FLAGS.only, dry_run=FLAGS.dry_run,
                        sft_cache_dir=FLAGS.sft_cache_dir)
  except SweepError as e:
    sys.exit(str(e))
  except KeyboardInterrupt:
    logging.error("Interrupted; running points were terminated.")
    sys.exit(130)
  except Terminated:
    logging.error("SIGTERM; running points were terminated.")
    sys.exit(143)
  if FLAGS.dry_run:
    return
  counts = collections.Counter(r["status"] for r in records)
  summary = ", ".join(f"{counts[s]} {s}"
                      for s in ("finished", "skipped", "failed"))
  print(f"sweep {FLAGS.workdir}: {summary}", flush=True)
  message = failure_message(records)
  if message:
    sys.exit(message)


if __name__ == "__main__":
  define_flags()
  app.run(main)
