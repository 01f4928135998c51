r"""Throughput of the shared-memory ring vs multiprocessing.Queue vs memcpy.

Producer and consumer run in separate processes (spawn). For each record size
the producer sends the same NumPy payload ``count`` times; the consumer gets a
private copy of every record. Figures:

* ``ring``         RingWriter.write -> RingReader.read (XXH3-64 checksum)
* ``ring_mac``     the same on an authenticated ring (``authenticate=True``,
  the trainer's: a 16-byte AES-GMAC per record instead of the checksum)
* ``queue``        multiprocessing.Queue.put(ndarray) -> get()
* ``memcpy``       same-process ``np.copyto`` of the same bytes
* ``native_copy``  the bound: ``ring_native.c``, the same two-process transfer
  in C with no checksum (memcpy in, memcpy out), same lane size
* ``native_view``  the same, consumer reads every byte in place (no copy out:
  the bound of a zero-copy consumer, which the ring does not offer)
* ``native_copy_xxh3`` / ``native_view_xxh3``  the same with the ring's
  checksum (XXH3-64) fused into the copies; only with ``--xxhash_include DIR``,
  a folder holding ``xxhash.h`` (e.g. ``deps/xxhash`` of the ``xxhash`` sdist:
  ``pip download xxhash==4.1.0 --no-binary :all: --no-deps``)

The native figures (``--native``, default when a C compiler is found; built
with ``cc -O3 -march=native`` into a temporary folder) show what this machine
allows any implementation: what they do not reach, no Python ring can.

Payloads and the memcpy buffers are page-aligned (``_page_aligned``: a copy
1-63 bytes "ahead" of its source modulo 4 KiB is ~10x slower on this CPU, and
malloc placement otherwise decides whether the baseline hits it).

Both sides first move untimed warm-up records (the ring: one pass over the
lane, so first-touch page faults are not timed). Timing starts when the
producer is ready to send and ends when the consumer
holds the last record. The implementations alternate within each repetition
so that their ratios are measured side by side; each figure is the median
over ``--repeats`` runs. One JSON line per (impl, size); the last line holds
``ratio_vs_queue`` and ``fraction_of_memcpy`` at 1 MiB, and both per size.

The size of a trajectory record with and without a mixture-of-experts
policy's routed experts, and the ring's tokens/s on such records:
``ring_routing.py``.

``--ceiling`` instead prints, per size, each side's CPU per record in one
process (write a burst, then read it) and the implied best fraction of memcpy
for a two-process pipeline: ``memcpy_us / max(write_us, read_us)``.

``*_per_core`` figures divide the bytes by the CPU time of the busier process
instead of wall time: the throughput each design would reach with a core per
process, which does not move with the load of a shared machine. The ring's
waits first spin on ``sched_yield``, which counts as CPU, so its per-core
figures are lower bounds.

  .venv/bin/python experiments/bench/ring.py --repeats 3
"""

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from sao_jax.ipc import ring

_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
_CTX = mp.get_context("spawn")


def _count(size: int, total_bytes: int) -> int:
  return max(8, min(20_000, total_bytes // size))


def _lane_bytes(size: int) -> int:
  """A lane of >= 4 records and >= 8 MiB (fits the 32 MiB L3 when it can)."""
  return max(8 << 20, 4 * (size + 4096))


def _payload(size: int) -> np.ndarray:
  """Random bytes at a page-aligned address (see ``_page_aligned``)."""
  out = _page_aligned(size)
  out[:] = np.random.default_rng(0).integers(0, 256, size, np.uint8)
  return out


def _page_aligned(size: int) -> np.ndarray:
  """An uninitialised uint8 array whose data starts on a 4 KiB boundary.

  On this CPU (AMD Zen 3, glibc 2.36 ``rep movsb``) a copy whose destination
  is 1-63 bytes past the source modulo 4 KiB runs ~10x slower. Where
  ``malloc`` puts two buffers decides whether the memcpy baseline hits that
  case (it did in some runs: 1.8 instead of 22 GB/s at 64 KiB), so every
  buffer the script copies from or to is page-aligned.
  """
  base = np.empty(size + 4096, np.uint8)
  skip = -base.ctypes.data % 4096
  return base[skip:skip + size]


def _warm(size: int) -> int:
  """Untimed records that touch every page of the lane once (first-touch)."""
  return _lane_bytes(size) // size + 1


def _ring_producer(name, size, count, ready, go, cpu, key=None):
  payload = _payload(size)
  with ring.RingWriter(name, lane=0, timeout=120.0, key=key) as w:
    for _ in range(_warm(size)):
      w.write(payload)
    ready.set()
    go.wait()
    c0 = time.process_time()
    for _ in range(count):
      w.write(payload)
    cpu.value = time.process_time() - c0


def _queue_producer(q, size, count, ready, go, cpu):
  payload = _payload(size)
  for _ in range(min(64, _warm(size))):
    q.put(payload)
  ready.set()
  go.wait()
  c0 = time.process_time()
  for _ in range(count):
    q.put(payload)
  q.close()
  q.join_thread()  # The feeder thread pickles and writes; count its CPU too.
  cpu.value = time.process_time() - c0


def _figures(nbytes: int, wall: float, *cpus: float) -> tuple[float, float]:
  """(GB/s over wall time, GB/s if each process had its own core).

  The second figure divides by the CPU time of the busier side, so it does
  not depend on how many other processes share the cores.
  """
  return nbytes / wall / 1e9, nbytes / max(*cpus, 1e-9) / 1e9


def run_ring(size: int, count: int,
             authenticate: bool = False) -> tuple[float, float]:
  with ring.RingReader.create(1, _lane_bytes(size),
                              authenticate=authenticate) as r:
    ready, go, cpu = _CTX.Event(), _CTX.Event(), _CTX.Value("d", 0.0)
    p = _CTX.Process(target=_ring_producer,
                     args=(r.name, size, count, ready, go, cpu, r.key))
    p.start()
    for _ in range(_warm(size)):
      r.read(timeout=120.0)
    ready.wait(120)
    t0, c0 = time.perf_counter(), time.process_time()
    go.set()
    for _ in range(count):
      rec = r.read(timeout=120.0)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert rec.data.nbytes == size
    del rec
    p.join(60)
  return _figures(size * count, dt, dc, cpu.value)


def run_queue(size: int, count: int) -> tuple[float, float]:
  q = _CTX.Queue(maxsize=max(2, _lane_bytes(size) // size))
  ready, go, cpu = _CTX.Event(), _CTX.Event(), _CTX.Value("d", 0.0)
  p = _CTX.Process(target=_queue_producer,
                   args=(q, size, count, ready, go, cpu))
  p.start()
  for _ in range(min(64, _warm(size))):
    q.get(timeout=120.0)
  ready.wait(120)
  t0, c0 = time.perf_counter(), time.process_time()
  go.set()
  for _ in range(count):
    arr = q.get(timeout=120.0)
  dt, dc = time.perf_counter() - t0, time.process_time() - c0
  assert arr.nbytes == size
  p.join(60)
  return _figures(size * count, dt, dc, cpu.value)


def run_memcpy(size: int, count: int) -> tuple[float, float]:
  src = _payload(size)
  dst = _page_aligned(size)
  count *= max(1, (1 << 30) // (size * count))  # >= 1 GiB: steadier timing.
  t0, c0 = time.perf_counter(), time.process_time()
  for _ in range(count):
    np.copyto(dst, src)
  dt, dc = time.perf_counter() - t0, time.process_time() - c0
  return _figures(size * count, dt, dc)


def _compiler() -> str | None:
  """Path of the C compiler (``$CC``, else ``cc``), or None."""
  return shutil.which(os.environ.get("CC", "cc"))


def build_native(folder: str, xxhash_include: str | None = None) -> str:
  """Compiles ``ring_native.c`` into ``folder``; returns the executable.

  With ``xxhash_include`` (a folder holding ``xxhash.h``) it also has the
  ``*_xxh3`` modes.
  """
  cc = _compiler()
  if cc is None:
    raise FileNotFoundError(
        "No C compiler (cc or $CC) on PATH for the native bound; install gcc "
        "or run with --no-native.")
  src = pathlib.Path(__file__).with_name("ring_native.c")
  exe = os.path.join(folder, "ring_native")
  flags = ["-O3", "-march=native"]
  if xxhash_include is not None:
    if not os.path.isfile(os.path.join(xxhash_include, "xxhash.h")):
      raise FileNotFoundError(
          f"--xxhash_include {xxhash_include} has no xxhash.h; pass the "
          "deps/xxhash folder of the unpacked xxhash sdist.")
    flags += ["-DRING_NATIVE_XXH3", "-I", xxhash_include]
  proc = subprocess.run([cc, *flags, "-o", exe, str(src)],
                        capture_output=True, text=True, check=False)
  if proc.returncode:
    raise RuntimeError(f"{cc} failed on {src}:\n{proc.stderr}")
  return exe


def run_native(exe: str, size: int, count: int,
               mode: str) -> tuple[float, float]:
  """The C two-process transfer (a ``ring_native.c`` mode), same lane."""
  proc = subprocess.run(
      [exe, str(size), str(_lane_bytes(size)), str(count), mode],
      capture_output=True, text=True, check=False, timeout=600)
  if proc.returncode:
    raise RuntimeError(f"{exe} {mode} failed ({proc.returncode}): "
                       f"{proc.stderr.strip()}")
  out = json.loads(proc.stdout)
  return _figures(size * count, out["seconds"], out["consumer_cpu_s"],
                  out["producer_cpu_s"])


def ceiling(size: int, rounds: int) -> dict:
  """Per-record CPU of each ring side, one process, vs memcpy of the record.

  Writes a burst of records, then reads them; min over ``rounds``. A
  two-process pipeline with a free core per side cannot beat ``memcpy_us / max(write_us, read_us)`` of memcpy, before any cost of
  moving cache lines between cores.
  """
  payload, dst = _payload(size), _page_aligned(size)
  burst = max(1, _lane_bytes(size) // 2 // (size + 64))
  best = {}

  def timed(key, fn, n):
    t0 = time.perf_counter()
    for _ in range(n):
      fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    best[key] = min(best.get(key, dt), dt)

  for mac in ("", "_mac"):  # The checksummed ring, then the MAC'd one.
    with ring.RingReader.create(1, _lane_bytes(size),
                                authenticate=bool(mac)) as r:
      with ring.RingWriter(r.name, lane=0, key=r.key) as w:
        for _ in range(rounds):
          timed("memcpy_us", lambda: np.copyto(dst, payload), 4 * burst)
          timed(f"write{mac}_us", lambda: w.write(payload), burst)
          timed(f"read{mac}_us", r.read, burst)
  out = {"bench": "ring_ceiling", "record_bytes": size}
  out.update({k: round(v, 1) for k, v in best.items()})
  for mac in ("", "_mac"):
    out[f"max_fraction_of_memcpy{mac}"] = round(best["memcpy_us"] / max(
        best[f"write{mac}_us"], best[f"read{mac}_us"]), 3)
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--total_mib", type=int, default=256,
                      help="MiB moved per run (4 KiB runs cap at 20k records)")
  parser.add_argument("--sizes", type=int, nargs="*", default=_SIZES)
  parser.add_argument("--ceiling", action="store_true",
                      help="only print the one-process per-side cost ceiling")
  parser.add_argument("--native", action=argparse.BooleanOptionalAction,
                      default=None,
                      help="also run the C bound (default: if cc is found)")
  parser.add_argument("--xxhash_include", default=None,
                      help="folder with xxhash.h: adds the C bound with the "
                      "ring's checksum (native_*_xxh3)")
  args = parser.parse_args()
  if args.ceiling:
    for size in args.sizes:
      print(json.dumps(ceiling(size, rounds=max(5, 4 * args.repeats))),
            flush=True)
    return
  native = args.native
  if native is None:
    native = _compiler() is not None
    if not native:
      print("No C compiler found: skipping the native bound.", file=sys.stderr)
  modes = ("copy", "view")
  if args.xxhash_include is not None:
    native, modes = True, modes + ("copy_xxh3", "view_xxh3")
  with tempfile.TemporaryDirectory(prefix="ring_native_") as folder:
    exe = build_native(folder, args.xxhash_include) if native else None
    _throughput(args, exe, modes)


def _throughput(args: argparse.Namespace, exe: str | None,
                modes: tuple[str, ...]) -> None:
  """Runs every implementation per size, alternating; prints the figures."""
  impls = {
      "ring": run_ring,
      "ring_mac": lambda s, n: run_ring(s, n, authenticate=True),
      "queue": run_queue,
      "memcpy": run_memcpy,
  }
  if exe is not None:
    for mode in modes:
      impls[f"native_{mode}"] = (
          lambda s, n, mode=mode: run_native(exe, s, n, mode))
  medians, cpu_medians = {}, {}
  for size in args.sizes:
    count = _count(size, args.total_mib << 20)
    runs = {k: [] for k in impls}
    for _ in range(args.repeats):
      for name, fn in impls.items():
        runs[name].append(fn(size, count))
    med = lambda name, i: statistics.median(r[i] for r in runs[name])
    for name, vals in runs.items():
      medians[(name, size)] = m = med(name, 0)
      cpu_medians[(name, size)] = mc = med(name, 1)
      print(json.dumps({
          "bench": "ring_throughput", "impl": name, "record_bytes": size,
          "records": count, "gb_per_s": round(m, 3),
          "runs": [round(v[0], 3) for v in vals],
          "ratio_vs_queue": round(m / med("queue", 0), 2),
          "fraction_of_memcpy": round(m / med("memcpy", 0), 3),
          "gb_per_s_per_core": round(mc, 3),
          "fraction_of_memcpy_per_core": round(mc / med("memcpy", 1), 3),
      }), flush=True)
  ref = 1 << 20 if (1 << 20) in args.sizes else args.sizes[-1]
  frac = lambda name, d=medians: round(d[(name, ref)] / d[("memcpy", ref)], 3)
  print(json.dumps({
      "bench": "ring_summary", "record_bytes": ref,
      "ratio_vs_queue": round(
          medians[("ring", ref)] / medians[("queue", ref)], 2),
      "fraction_of_memcpy": frac("ring"),
      "fraction_of_memcpy_per_core": frac("ring", cpu_medians),
      "fraction_of_memcpy_by_size": {
          str(s): round(medians[("ring", s)] / medians[("memcpy", s)], 3)
          for s in args.sizes},
      "ratio_vs_queue_by_size": {
          str(s): round(medians[("ring", s)] / medians[("queue", s)], 2)
          for s in args.sizes},
      "mac_ratio_vs_queue_by_size": {
          str(s): round(medians[("ring_mac", s)] / medians[("queue", s)], 2)
          for s in args.sizes},
      "mac_of_ring_by_size": {
          str(s): round(medians[("ring_mac", s)] / medians[("ring", s)], 3)
          for s in args.sizes},
      **_native_summary(medians, args.sizes, modes if exe else ()),
  }), flush=True)


def _native_summary(medians: dict, sizes: list[int],
                    modes: tuple[str, ...]) -> dict:
  """Per size: the C bound's fractions of memcpy, and the ring's of the C."""
  if not modes:
    return {}
  ratio = lambda a, b, s: round(medians[(a, s)] / medians[(b, s)], 3)
  out = {}
  for mode in modes:
    out[f"fraction_of_memcpy_native_{mode}_by_size"] = {
        str(s): ratio(f"native_{mode}", "memcpy", s) for s in sizes}
  # The ring over the C transfer that moves and checks the bytes the same way.
  if "copy_xxh3" in modes:
    out["ring_of_native_copy_xxh3_by_size"] = {
        str(s): ratio("ring", "native_copy_xxh3", s) for s in sizes}
  return out


if __name__ == "__main__":
  main()
