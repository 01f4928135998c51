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
import functools
import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from absl import app
from absl import flags
from absl import logging

import sweep_plan

FLAGS = flags.FLAGS
_ATTEMPT_HEADER = "===== sweep attempt "

# (config path, point dir, overrides.json path) -> the command to run.
CommandFn = Callable[[str, str, str], list[str]]


class Terminated(Exception):
  """SIGTERM arrived (raised by the CLI's signal handler)."""


# --------------------------------------------------------------------- run ---


def main_command(config_path: str, point_dir: str,
                 overrides_path: str, extra: Sequence[str] = ()) -> list[str]:
  """The trainer command of one point (``extra``: more trainer flags)."""
  return [sys.executable, "-m", "sao_jax.main", f"--config={config_path}",
          f"--workdir={point_dir}", *extra, f"--overrides={overrides_path}"]


@dataclasses.dataclass
class _Running:
  point: sweep_plan.PlannedPoint
  proc: subprocess.Popen
  start: float
  log: Any


def _emit(point: sweep_plan.PlannedPoint, status: str,
          wall_s: float) -> dict[str, Any]:
  record = {"point": point.name, "status": status,
            "wall_s": round(wall_s, 3), "log": str(point.log_path)}
  print(json.dumps(record), flush=True)
  return record


def _start(point: sweep_plan.PlannedPoint, config_path: str,
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
  proc = subprocess.Popen(cmd, cwd=sweep_plan.REPO, stdout=log,
                          stderr=subprocess.STDOUT,
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
    SweepError: the sweep cannot start (see `sweep_plan.plan`).
  """
  if parallel < 1:
    raise sweep_plan.SweepError(
        f"--parallel: expected an int >= 1, got {parallel}")
  config_path = str(pathlib.Path(config_path).resolve())
  workdir = pathlib.Path(workdir).resolve()
  points = sweep_plan.load_points(config_path)
  selected = sweep_plan.select(points, only)
  planned = sweep_plan.plan(config_path, workdir, selected,
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
  sweep_plan.write_plan(config_path, workdir, points, planned)
  logging.info("Sweep of %s in %s: %d points (%d finished), %d at a time",
               config_path, workdir, len(planned),
               sum(p.status == "finished" for p in planned), parallel)
  records = []
  pending = collections.deque()
  for p in planned:
    if p.status == "finished":
      logging.info("Point %s is finished (%s exists); skipping", p.name,
                   p.dir / sweep_plan.SUMMARY_FILE)
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
        if rc == 0 and (r.point.dir / sweep_plan.SUMMARY_FILE).exists():
          logging.info("Point %s finished in %.1f s", name, wall_s)
          records.append(_emit(r.point, "finished", wall_s))
        else:
          why = (f"exit status {rc}" if rc else
                 f"exit status 0 without writing {sweep_plan.SUMMARY_FILE}")
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
  flags.DEFINE_multi_string(
      "main_flag", [], "A flag added to every point's trainer command, before "
      "its --overrides (e.g. --main_flag=--config.train.num_steps=2).")
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
                        sft_cache_dir=FLAGS.sft_cache_dir,
                        command_fn=functools.partial(
                            main_command, extra=FLAGS.main_flag))
  except sweep_plan.SweepError as e:
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
