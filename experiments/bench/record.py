r"""Benchmark: what recording the trajectory stream costs the trainer.

Three figures, medians of ``--repeats`` runs, each JSON line with the load
average (``os.getloadavg``) at its end:

* ``record_us_per_trajectory``: the recorder's own work per trajectory
  (``StreamRecorder.add``: codec encode + ArrayRecord write, shards cut as in
  a run) for episodes of ``--seq_len`` tokens, half of them actions.
* ``async_steps_per_s``: trainer steps per second of the real async loop
  (sampler process + ring + trainer, steady state: compilation excluded) with
  ``train.record_stream`` off and on, runs alternating.
* ``replay_steps_per_s``: the trainer alone (a replay of the recorded run,
  no sampler to wait for): its step time bounds what recording can cost.

  python experiments/bench/record.py --repeats=3
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

import loop_setup

_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per figure (medians).")
_STEPS = flags.DEFINE_integer("steps", 20, "Policy steps per loop run.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Tokens per trajectory "
                                "(microbenchmark).")
_TRAJECTORIES = flags.DEFINE_integer("trajectories", 2000, "Trajectories per "
                                     "microbenchmark run.")
_WARMUP_ROUNDS = flags.DEFINE_integer(
    "warmup_rounds", 1, "Untimed loop rounds first (they fill the "
    "compilation caches).")
_SET = flags.DEFINE_multi_string(
    "set", [], "KEY=VALUE: a config override of every loop run (dotted key "
    "of configs/base.py, JSON value), e.g. --set=model.num_layers=1.")


def _trajectories(n: int, seq_len: int):
  # pylint: disable-next=g-import-not-at-top
  from sao_jax.data import trajectory as traj_lib

  rng = np.random.default_rng(0)
  mask = np.zeros(seq_len, np.uint8)
  mask[seq_len // 2:] = 1
  return [traj_lib.Trajectory(
      prompt_id=i, tokens=rng.integers(0, 512, seq_len),
      action_mask=mask, rollout_logp=rng.standard_normal(seq_len) * mask,
      policy_version=np.where(mask, 3, traj_lib.NO_VERSION),
      rewards=np.zeros(seq_len)) for i in range(n)]


def record_cost(tmp: str) -> None:
  from sao_jax.data import record  # pylint: disable=g-import-not-at-top

  trajs = _trajectories(_TRAJECTORIES.value, _SEQ_LEN.value)
  times = []
  for i in range(_REPEATS.value):
    rec = record.StreamRecorder(os.path.join(tmp, f"micro{i}"), start_step=0,
                                shard_steps=100)
    t0 = time.perf_counter()
    for j, traj in enumerate(trajs):
      rec.add(traj, 1, True)
      if j % 16 == 15:
        rec.batch_done(None)
    rec.close()
    times.append((time.perf_counter() - t0) / len(trajs) * 1e6)
  loop_setup.emit("record_us_per_trajectory",
                  value=statistics.median(times), runs=times,
                  seq_len=_SEQ_LEN.value)


def loop_config(record_stream: bool, **overrides):
  """The quickstart model and task (``loop_setup.loop_config``), short
  episodes, then the ``--set`` overrides."""
  return loop_setup.loop_config(_STEPS.value, {
      "sampler.max_new_tokens": 16, "sampler.max_total_tokens": 64,
      "train.max_seq_len": 64, **loop_setup.parse_sets(_SET.value),
      "train.record_stream": record_stream, **overrides})


def _steps_per_s(summary) -> float:
  return summary["train_wall_steps"] / max(1e-9, summary["train_wall_s"])


def loop_cost(tmp: str) -> None:
  from sao_jax.train import loop  # pylint: disable=g-import-not-at-top

  rates = {"off": [], "on": [], "replay": []}
  recorded = None
  # Warm-up rounds fill the compilation caches; the order of the three kinds
  # rotates each round so that drifts in machine load spread evenly.
  warmup = _WARMUP_ROUNDS.value
  for i in range(warmup + _REPEATS.value):
    kinds = ["off", "on", "replay"]
    kinds = kinds[i % 3:] + kinds[:i % 3]
    if recorded is None:  # The first round needs a recording to replay.
      kinds.remove("on")
      kinds.insert(0, "on")
    for kind in kinds:
      workdir = os.path.join(tmp, f"{kind}_{i}")
      config = (loop_config(False, **{"train.mode": "replay",
                                      "train.replay_from": recorded})
                if kind == "replay" else loop_config(kind == "on"))
      summary = loop.train_and_evaluate(config, workdir)
      recorded = workdir if kind == "on" else recorded
      if i >= warmup:
        rates[kind].append(_steps_per_s(summary))
  for kind in ("off", "on"):
    loop_setup.emit("async_steps_per_s", record_stream=kind == "on",
                    value=statistics.median(rates[kind]), runs=rates[kind],
                    steps=_STEPS.value)
  loop_setup.emit("replay_steps_per_s",
                  value=statistics.median(rates["replay"]),
                  runs=rates["replay"], steps=_STEPS.value)


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    record_cost(tmp)
    loop_cost(tmp)


if __name__ == "__main__":
  app.run(main)
