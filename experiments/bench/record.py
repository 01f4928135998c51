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

import json
import os
import statistics
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

_REPEATS = flags.DEFINE_integer("repeats", 3, "Runs per figure (medians).")
_STEPS = flags.DEFINE_integer("steps", 20, "Policy steps per loop run.")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 256, "Tokens per trajectory "
                                "(microbenchmark).")
_TRAJECTORIES = flags.DEFINE_integer("trajectories", 2000, "Trajectories per "
                                     "microbenchmark run.")


def _emit(figure: str, **values) -> None:
  print(json.dumps({"figure": figure, **values,
                    "loadavg_1m": round(os.getloadavg()[0], 2)}))


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
  _emit("record_us_per_trajectory", value=statistics.median(times),
        runs=times, seq_len=_SEQ_LEN.value)


def loop_config(record_stream: bool, **overrides):
  """The quickstart model and task, no SFT or evaluation, short episodes."""
  from configs import quickstart  # pylint: disable=g-import-not-at-top

  config = quickstart.get_config()
  config.train.num_steps = _STEPS.value
  config.train.sft_steps = 0
  config.train.eval_every = 0
  config.train.checkpoint_every = 0
  config.env.eval_size = 8
  config.rl.critic_warmup_steps = 0
  config.sampler.max_new_tokens = 16
  config.sampler.max_total_tokens = 64
  config.train.max_seq_len = 64
  config.train.record_stream = record_stream
  for key, value in overrides.items():
    section, leaf = key.split(".")
    config[section][leaf] = value
  return config


def _steps_per_s(summary) -> float:
  return summary["train_wall_steps"] / max(1e-9, summary["train_wall_s"])


def loop_cost(tmp: str) -> None:
  from sao_jax.train import loop  # pylint: disable=g-import-not-at-top

  rates = {"off": [], "on": [], "replay": []}
  recorded = None
  # One warm-up round fills the compilation caches; the order of the three
  # kinds rotates each round so that drifts in machine load spread evenly.
  for i in range(_REPEATS.value + 1):
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
      if i:
        rates[kind].append(_steps_per_s(summary))
  for kind in ("off", "on"):
    _emit("async_steps_per_s", record_stream=kind == "on",
          value=statistics.median(rates[kind]), runs=rates[kind],
          steps=_STEPS.value)
  _emit("replay_steps_per_s", value=statistics.median(rates["replay"]),
        runs=rates["replay"], steps=_STEPS.value)


def main(argv):
  del argv
  with tempfile.TemporaryDirectory() as tmp:
    record_cost(tmp)
    loop_cost(tmp)


if __name__ == "__main__":
  app.run(main)
