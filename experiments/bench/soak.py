r"""Soak: a long tiny async run that survives sampler kills and trainer resumes.

One clean run (the baseline) and one soaked run of the same config and steps,
each ``python -m sao_jax.main`` in a fresh workdir. During the soaked run the
sampler process is SIGKILLed at random (every ``--kill_every_s`` seconds on
average, uniform in [0.5, 1.5] of it) and the trainer is SIGTERMed
``--resumes`` times (evenly over the steps, once a checkpoint is past each
mark) and started again on the same workdir, which resumes it
(docs/design/failures.md: sampler restarts, resume, one run per workdir). Prints
one JSON line per segment of the soaked run and a last one with the figures:
kills, sampler restarts the trainers logged, resumes, steps/s of both runs and
the share lost to faults, and the exactly-once counters of the final summary
(``episodes_consumed_twice`` must be 0; watermark + above it = records read:
every record read was a distinct episode), with the machine load.

  python experiments/bench/soak.py --steps=2000 --kill_every_s=30 --resumes=3
  python experiments/bench/soak.py --steps=200 --kill_every_s=20 --resumes=2
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import psutil

import loop_setup

_STEPS = flags.DEFINE_integer("steps", 2000, "Policy steps of each run.")
_KILL_EVERY_S = flags.DEFINE_float(
    "kill_every_s", 30.0, "Mean seconds between sampler SIGKILLs.")
_RESUMES = flags.DEFINE_integer(
    "resumes", 3, "Trainer SIGTERMs (each followed by a resume).")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", 20, "train.checkpoint_every of the runs.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the kill times.")
_CONFIG = flags.DEFINE_string("config", "configs/quickstart.py",
                              "Config file of both runs.")
_BASELINE = flags.DEFINE_bool("baseline", True,
                              "Also time a clean run of the same steps.")
_MAIN_FLAGS = flags.DEFINE_multi_string(
    "main_flag", [], "A flag added to every run's command (e.g. "
    "--main_flag=--config.model.num_layers=1).")


def _overrides(steps: int) -> list[str]:
  """The tiny long run: no SFT or evaluation, restarts unbounded."""
  return [f"--config.{k}={v}" for k, v in {
      "train.num_steps": steps, "train.sft_steps": 0,
      "train.eval_every": 0, "env.eval_size": 8,
      "rl.critic_warmup_steps": 0, "train.log_every": 20,
      "train.checkpoint_every": _CHECKPOINT_EVERY.value,
      "sampler.max_restarts": 100_000, "sampler.max_restarts_per_window": 0,
  }.items()]


def _command(workdir: str) -> list[str]:
  return [sys.executable, "-m", "sao_jax.main", f"--config={_CONFIG.value}",
          f"--workdir={workdir}", *_overrides(_STEPS.value),
          *_MAIN_FLAGS.value]


def _latest_checkpoint(workdir: str) -> int:
  path = os.path.join(workdir, "checkpoints")
  steps = [int(d) for d in os.listdir(path) if d.isdigit()] if os.path.isdir(
      path) else []
  return max(steps, default=0)


def _samplers(trainer: subprocess.Popen) -> list[psutil.Process]:
  """The trainer's sampler processes (spawned children, not the tracker)."""
  try:
    children = psutil.Process(trainer.pid).children()
  except psutil.NoSuchProcess:
    return []
  out = []
  for child in children:
    try:
      cmd = " ".join(child.cmdline())
    except psutil.Error:
      continue
    if "multiprocessing" in cmd and "resource_tracker" not in cmd:
      out.append(child)
  return out


def _segment(workdir: str, log_path: str, rng: random.Random,
             stop_at_step: int | None) -> dict:
  """Runs (or resumes) the trainer, killing its sampler at random; SIGTERMs
  it once a checkpoint reaches ``stop_at_step`` (None: runs to the end)."""
  kills = 0
  with open(log_path, "w") as log:
    trainer = subprocess.Popen(_command(workdir), cwd=loop_setup.REPO,
                               stdout=log, stderr=subprocess.STDOUT)
    next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * _KILL_EVERY_S.value
    terminated = False
    while trainer.poll() is None:
      time.sleep(0.2)
      if time.monotonic() >= next_kill:
        for sampler in _samplers(trainer):
          try:
            sampler.send_signal(signal.SIGKILL)
            kills += 1
          except psutil.NoSuchProcess:
            pass
        next_kill = time.monotonic() + rng.uniform(
            0.5, 1.5) * _KILL_EVERY_S.value
      if (not terminated and stop_at_step is not None
          and _latest_checkpoint(workdir) >= stop_at_step):
        trainer.send_signal(signal.SIGTERM)
        terminated = True
    rc = trainer.wait()
  with open(log_path) as f:
    text = f.read()
  if not terminated and rc != 0:
    raise RuntimeError(f"The run failed (exit {rc}); its log {log_path} "
                       f"ends:\n{text[-3000:]}")
  return {"rc": rc, "kills": kills, "sigterm": terminated,
          "restarts_logged": text.count("Restarting the sampler (restart "),
          "checkpoint": _latest_checkpoint(workdir)}


def _timed_run(workdir: str, soak: bool, tmp: str) -> tuple[float, list]:
  """Wall seconds of a whole run (all its segments) and the segments."""
  rng = random.Random(_SEED.value)
  total = _STEPS.value  # No critic warm-up: steps = policy steps.
  marks = [total * (k + 1) // (_RESUMES.value + 1)
           for k in range(_RESUMES.value)] if soak else []
  segments = []
  start = time.perf_counter()
  for i, mark in enumerate([*marks, None]):
    log = os.path.join(tmp, f"{'soak' if soak else 'clean'}_{i}.log")
    seg = (_segment(workdir, log, rng, mark) if soak
           else _segment_clean(workdir, log))
    segments.append(seg)
    loop_setup.emit("soak_segment" if soak else "clean_run", segment=i,
                    **seg)
  return time.perf_counter() - start, segments


def _segment_clean(workdir: str, log_path: str) -> dict:
  with open(log_path, "w") as log:
    rc = subprocess.run(_command(workdir), cwd=loop_setup.REPO, stdout=log,
                        stderr=subprocess.STDOUT, check=False).returncode
  if rc:
    with open(log_path) as f:
      raise RuntimeError(f"The clean run failed (exit {rc}):\n"
                         f"{f.read()[-3000:]}")
  return {"rc": rc}


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    figures = {"steps": _STEPS.value, "kill_every_s": _KILL_EVERY_S.value,
               "resumes": _RESUMES.value, "config": _CONFIG.value,
               "load_before": round(os.getloadavg()[0], 2)}
    if _BASELINE.value:
      clean_s, _ = _timed_run(os.path.join(tmp, "clean"), False, tmp)
      figures["clean_wall_s"] = clean_s
      figures["clean_steps_per_s"] = _STEPS.value / clean_s
    workdir = os.path.join(tmp, "soak")
    soak_s, segments = _timed_run(workdir, True, tmp)
    with open(os.path.join(workdir, "summary.json")) as f:
      summary = json.load(f)
    figures.update(
        soak_wall_s=soak_s, soak_steps_per_s=_STEPS.value / soak_s,
        sampler_kills=sum(s["kills"] for s in segments),
        sampler_restarts=sum(s["restarts_logged"] for s in segments),
        trainer_resumes=sum(s["sigterm"] for s in segments),
        final_segment_restarts=summary["sampler_restarts"],
        final_segment_downtime_s=summary["sampler_downtime_s"],
        steps_done=summary["steps"],
        records_read=summary["trajectories_read_from_ring"],
        episodes_watermark=summary["episodes_watermark"],
        episodes_above_watermark=summary["episodes_above_watermark"],
        episodes_consumed_twice=summary["episodes_consumed_twice"],
        episodes_lost_in_partial_groups=summary[
            "episodes_lost_in_partial_groups"],
        exactly_once=(summary["episodes_consumed_twice"] == 0
                      and summary["episodes_watermark"]
                      + summary["episodes_above_watermark"]
                      == summary["trajectories_read_from_ring"]))
    if _BASELINE.value:
      figures["steps_per_s_lost_frac"] = 1.0 - (
          figures["soak_steps_per_s"] / figures["clean_steps_per_s"])
    loop_setup.emit("soak", **figures)


if __name__ == "__main__":
  app.run(main)
