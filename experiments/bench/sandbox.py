r"""Calls per second and latency of the code sandbox (sao_jax/sandbox).

Arms, each running ``print(1 + 1)`` (and, with ``--numpy``, a small numpy
call) ``--calls`` times per repetition:

* ``bare``            ``python -I -c`` in a plain subprocess (no isolation)
* ``strict``          a fresh sandbox per call (bwrap, or ``--mechanism``),
                      calls back to back: each waits for the next sandbox's
                      start-up
* ``strict_paced``    the same with ``--pace_ms`` of idle time between a
                      thread's calls (as a sampler decoding between tool
                      calls), in which the next fresh sandbox starts; the
                      latency excludes the pause, the rate includes it
* ``warm``            a warm sandbox, a clean slate per call, calls back to
                      back
* ``warm_paced``      the same with ``--pace_ms`` between a thread's calls
* ``warm_preload``    ``warm`` with numpy and sympy imported once

each with ``--workers`` 1 and 2 (that many threads calling one pool of that
many sandboxes). The arms alternate within each repetition so that their
ratios are measured side by side; each figure is the median over
``--repeats`` repetitions of calls/s, p50 and p99 (ms, over all calls of a
repetition). One JSON line per (arm, workers), with the machine's load
average before and after: this machine is shared, so absolute figures move
with the others' load and the ratios to ``bare`` are the ones to compare.

  .venv/bin/python experiments/bench/sandbox.py --calls 100 --repeats 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

from sao_jax.sandbox import Limits
from sao_jax.sandbox import SandboxPool

_CODE = "print(1 + 1)"
_NUMPY_CODE = "import numpy as np\nprint(int(np.arange(10).sum()))"


class _Bare:
  """The baseline: a plain `python -I -c` per call."""

  def run(self, code):
    subprocess.run([sys.executable, "-I", "-c", code], capture_output=True,
                   check=True)

  def close(self):
    pass


def _make(arm, workers, mechanism):
  if arm == "bare":
    return _Bare()
  mode = "strict" if arm.startswith("strict") else "warm"
  preload = ("numpy", "sympy") if arm == "warm_preload" else ()
  return SandboxPool(Limits(), workers=workers, mode=mode,
                     mechanism=mechanism, preload=preload)


def _measure(runner, code, calls, workers, pace_s=0.0):
  """(calls/s, latencies in ms) of `calls` calls from `workers` threads,
  each pausing `pace_s` before every call."""
  lat = []
  lock = threading.Lock()
  per_thread = calls // workers

  def work():
    for _ in range(per_thread):
      time.sleep(pace_s)
      t0 = time.perf_counter()
      runner.run(code)
      dt = (time.perf_counter() - t0) * 1000
      with lock:
        lat.append(dt)

  threads = [threading.Thread(target=work) for _ in range(workers)]
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  wall = time.perf_counter() - t0
  return per_thread * workers / wall, sorted(lat)


def _quantile(values, q):
  return values[min(len(values) - 1, int(q * len(values)))]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--calls", type=int, default=100)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--mechanism", default="bwrap")
  parser.add_argument("--workers", default="1,2")
  parser.add_argument("--arms",
                      default="bare,strict,strict_paced,warm,warm_paced,"
                      "warm_preload")
  parser.add_argument("--pace_ms", type=float, default=50.0,
                      help="idle time before each call of a *_paced arm")
  parser.add_argument("--numpy", action="store_true",
                      help="run a numpy call instead of print(1 + 1)")
  args = parser.parse_args()
  code = _NUMPY_CODE if args.numpy else _CODE
  arms = args.arms.split(",")
  worker_counts = [int(w) for w in args.workers.split(",")]
  load_before = os.getloadavg()
  runners = {(a, w): _make(a, w, args.mechanism) for a in arms
             for w in worker_counts}
  figures = {key: [] for key in runners}
  try:
    for runner in runners.values():  # Warm-up (first imports, page cache).
      for _ in range(3):
        runner.run(code)
    for _ in range(args.repeats):
      for key, runner in runners.items():
        pace_s = args.pace_ms / 1000 if key[0].endswith("_paced") else 0.0
        figures[key].append(_measure(runner, code, args.calls, key[1],
                                     pace_s))
  finally:
    for runner in runners.values():
      runner.close()
  load_after = os.getloadavg()
  bare = {w: statistics.median(r for r, _ in figures[("bare", w)])
          for w in worker_counts if ("bare", w) in figures}
  for (arm, w), runs in figures.items():
    rate = statistics.median(r for r, _ in runs)
    line = {
        "figure": f"sandbox_{arm}", "workers": w, "mechanism": (
            "unsafe_subprocess" if arm == "bare" else args.mechanism),
        "code": "numpy" if args.numpy else "print",
        "calls_per_s": round(rate, 1),
        "p50_ms": round(statistics.median(_quantile(l, 0.5) for _, l in runs),
                        2),
        "p99_ms": round(statistics.median(_quantile(l, 0.99) for _, l in runs),
                        2),
        "rate_vs_bare": (round(rate / bare[w], 2)
                         if w in bare and not arm.endswith("_paced")
                         else None),
        "pace_ms": args.pace_ms if arm.endswith("_paced") else 0.0,
        "calls": args.calls, "repeats": args.repeats,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
  main()
