r"""Benchmark: wall time of async vs sync SAO on the same number of trajectories.

The policy is the quickstart's architecture at random init (no SFT), on the
quickstart's tool-use task; ``--max_new_tokens`` sets how long episodes are,
i.e. how generation time compares with training time (printed per run as the
idle fractions of the sync runs).

Both modes run the real loop (sampler process + ring + trainer) on the same
config; the sampler is pinned to one core and the trainer to the other. The
figure is the time from the sampler's start to the last train step
(``train_wall_s``: no SFT, no evaluation). Runs alternate sync/async and the
medians are compared. With generation and training taking equal time the
ideal ratio (sync / async) is 2.0.

  python experiments/bench/async_vs_sync.py --repeats=3

Prints one JSON line per run and per figure; the last line has ``ratio``.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile

from absl import app
from absl import flags
from absl import logging

import loop_setup

_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per mode (medians).")
_STEPS = flags.DEFINE_integer("steps", 40, "Policy steps per run.")
_STALENESS = flags.DEFINE_integer("max_staleness", 4, "Async staleness bound.")
_SAMPLER_CORE = flags.DEFINE_integer("sampler_core", 0, "Core of the sampler.")
_TRAINER_CORE = flags.DEFINE_integer("trainer_core", 1, "Core of the trainer.")
_CRITIC_UPDATES = flags.DEFINE_integer(
    "critic_updates", 1, "Critic updates per step (training cost).")
_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", 96,
    "Tokens per turn: sets the generation/training balance (the random-init "
    "policy rarely stops early, so episodes use the budget).")


def bench_config(mode: str):
  """The quickstart model and task (``loop_setup.loop_config``) in ``mode``."""
  n = _NEW_TOKENS.value
  return loop_setup.loop_config(_STEPS.value, {
      "train.mode": mode, "train.max_staleness": _STALENESS.value,
      "train.log_every": 10,
      "rl.critic_updates_per_step": _CRITIC_UPDATES.value,
      "sampler.devices": str(_SAMPLER_CORE.value),
      "sampler.max_new_tokens": n, "sampler.max_total_tokens": 32 + n,
      "train.max_seq_len": 32 + n})


def main(argv):
  del argv
  # Pin before JAX starts its thread pools; the sampler pins itself.
  os.sched_setaffinity(0, {_TRAINER_CORE.value})
  from sao_jax.train import loop  # pylint: disable=g-import-not-at-top

  times = {"sync": [], "async": []}
  with tempfile.TemporaryDirectory() as tmp:
    # One warm-up run of each mode fills the compilation caches of the trainer.
    for i in range(_REPEATS.value + 1):
      for mode in ("sync", "async"):
        workdir = os.path.join(tmp, f"{mode}_{i}")
        summary = loop.train_and_evaluate(bench_config(mode), workdir)
        if i == 0:
          continue
        times[mode].append(summary["train_wall_s"])
        loop_setup.emit(
            "run", mode=mode, repeat=i,
            train_wall_s=summary["train_wall_s"],
            trajectories_trained=summary["trajectories_trained"],
            staleness_mean=summary["staleness_mean"],
            sampler_idle_frac=summary["sampler_idle_frac"],
            trainer_idle_frac=summary["trainer_idle_frac"])
  med = {m: statistics.median(t) for m, t in times.items()}
  for mode, t in med.items():
    loop_setup.emit(f"{mode}_wall_s_median", value=t, runs=times[mode])
  logging.info("sync %.1fs, async %.1fs", med["sync"], med["async"])
  print(json.dumps({"sync_s": med["sync"], "async_s": med["async"],
                    "ratio": med["sync"] / med["async"],
                    "steps": _STEPS.value, "repeats": _REPEATS.value}))


if __name__ == "__main__":
  app.run(main)
