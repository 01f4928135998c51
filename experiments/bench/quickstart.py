r"""Benchmark: the quickstart end to end, continuous vs batch sampler, side by side.

Each run is the README's quickstart as a user runs it, in a fresh process and
a fresh workdir (SFT warm start, held-out evaluation, asynchronous SAO,
evaluation again):

  python -m sao_jax.main --config=configs/quickstart.py --workdir=DIR [ARM]

Arms (``--arms``):

- ``continuous``: the quickstart's config as shipped (continuous-batching
  sampler: slots refilled as episodes end, weights adopted in flight);
- ``batch``: the batch-synchronous sampler of before (``sampler.refill=False``,
  ``sampler.weight_poll_tokens=0``: a batch leaves when its last episode ends,
  weights change between batches);
- ``row_subsets``: continuous, but prefill/decode over row subsets
  (``sampler.row_subsets=True``, the default outside the quickstart);
- ``vllm``: the quickstart's config with vLLM behind the sampler's `Rollout`
  interface (``sampler.engine='vllm'``; the `vllm` extra, README "Rollout
  engines"): the held-out gain and wall with each engine via
  ``--arms=continuous,vllm``.

Runs alternate between the arms (``--repeats`` rounds), so every arm sees
the same machine load; figures are medians. Nothing is cached between runs
except what the OS caches (each run compiles and warm-starts from scratch).

  python experiments/bench/quickstart.py --repeats=2

Prints one JSON line per run and one per arm (medians); the last line has
``wall_ratio_vs_<arm>`` (the arm's median wall time over the first arm's) and
``gain_<arm>`` (held-out accuracy after RL minus before).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
from absl import logging

import loop_setup

_REPEATS = flags.DEFINE_integer("repeats", 2, "Runs per arm (medians).")
_ARMS = flags.DEFINE_list("arms", ["continuous", "batch"],
                          "Arms to run; the ratios are against the first.")
_CONFIG = flags.DEFINE_string("config", "configs/quickstart.py",
                              "Config file of every run.")
_MAIN_FLAGS = flags.DEFINE_multi_string(
    "main_flag", [], "A flag added to every run's command (e.g. "
    "--main_flag=--config.train.num_steps=2).")

ARMS = {
    "continuous": {},
    "batch": loop_setup.BATCH_SAMPLER,
    "row_subsets": {"sampler.row_subsets": True},
    "vllm": {"sampler.engine": "vllm"},
}
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def run_once(arm: str, workdir: str) -> dict[str, float]:
  """One quickstart run of ``arm`` in a new process; its figures."""
  flags_ = [f"--config.{k}={v}" for k, v in ARMS[arm].items()]
  cmd = [sys.executable, "-m", "sao_jax.main", f"--config={_CONFIG.value}",
         f"--workdir={workdir}", *flags_, *_MAIN_FLAGS.value]
  start = time.perf_counter()
  done = subprocess.run(cmd, cwd=_REPO, capture_output=True, text=True,
                        check=False)
  wall = time.perf_counter() - start
  if done.returncode:
    raise RuntimeError(f"{arm} run failed (exit {done.returncode}); its last "
                       f"output:\n{done.stderr[-3000:]}")
  with open(os.path.join(workdir, "summary.json")) as f:
    s = json.load(f)
  return {
      "wall_s": wall,
      "loop_wall_s": s["wall_s"],
      "train_wall_s": s["train_wall_s"],
      "accuracy_before": s["accuracy_before"],
      "accuracy_after": s["accuracy_after"],
      "gain": s["accuracy_after"] - s["accuracy_before"],
      "trainer_idle_frac": s["trainer_idle_frac"],
      "sampler_idle_frac": s["sampler_idle_frac"],
      "decode_occupancy": s["sampler_decode_occupancy"],
      "staleness_mean": s["staleness_mean"],
      "trajectories_trained": s["trajectories_trained"],
  }


def main(argv):
  del argv
  unknown = [a for a in _ARMS.value if a not in ARMS]
  if unknown:
    raise app.UsageError(f"Unknown arms {unknown}; choose from {list(ARMS)}.")
  runs = {arm: [] for arm in _ARMS.value}
  with tempfile.TemporaryDirectory() as tmp:
    for i in range(_REPEATS.value):
      for arm in _ARMS.value:
        logging.info("round %d of %d: %s", i + 1, _REPEATS.value, arm)
        runs[arm].append(run_once(arm, os.path.join(tmp, f"{arm}_{i}")))
        loop_setup.emit("run", arm=arm, repeat=i, **runs[arm][-1])
  med = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
         for arm, rs in runs.items()}
  for arm, figures in med.items():
    loop_setup.emit(f"{arm}_median", **figures,
                    wall_s_runs=[round(r["wall_s"], 1) for r in runs[arm]],
                    gain_runs=[round(r["gain"], 3) for r in runs[arm]])
  first = _ARMS.value[0]
  last = {"config": _CONFIG.value, "repeats": _REPEATS.value,
          **{f"{a}_wall_s": f["wall_s"] for a, f in med.items()},
          **{f"gain_{a}": f["gain"] for a, f in med.items()}}
  for arm in _ARMS.value[1:]:
    last[f"wall_ratio_vs_{arm}"] = med[arm]["wall_s"] / med[first]["wall_s"]
  logging.info("%s", last)
  print(json.dumps(last))


if __name__ == "__main__":
  app.run(main)
