"""What both sides of the trajectory ring share (docs/DESIGN.md §1).

The segment layout, the record header and its MAC, the ring's errors, typed
views of a segment, and the two primitives of its fault model: producer
liveness from ``/proc`` and the polling backoff. ``sao_jax.ipc.ring`` holds
the protocol (``RingReader``, ``RingWriter``) and its fault model.

    [global header 4 KiB][lane controls, 256 B each][lane 0 data][lane 1]...

Each lane is a byte ring with monotonic 64-bit ``head`` (written only by its
producer) and ``tail`` (written only by the consumer) counters; offsets are
``counter % lane_bytes``. A record is a 32-byte header (magic, length,
sequence number, XXH3-64 of the payload, 0 in a keyed ring) followed by the
payload and, in a keyed ring (``G_KEYED``), its 16-byte MAC, padded to 64
bytes and never split: when it does not fit before the end of the lane the
producer writes a *wrap* marker and continues at offset 0.
"""

from __future__ import annotations

import functools
import os
import struct
import time
from typing import Callable, NamedTuple

from absl import logging
import numpy as np
import xxhash

from sao_jax.ipc import mac
from sao_jax.ipc import segment

MAGIC = 0x5A0_12196  # Segment layout magic.
LAYOUT_VERSION = 4  # 4: optional per-record MAC (G_KEYED).
GLOBAL_BYTES = 4096
CTL_BYTES = 256
ALIGN = 64

# Global header words (uint64). G_KEYED: records carry a MAC trailer.
G_MAGIC, G_VERSION, G_LANES, G_LANE_BYTES, G_CLOSED, G_KEYED = range(6)

# Lane control words (int64). Producer-written words come first; the consumer's
# words live in a separate cache line (word 16 = byte 128).
(HEAD, RECORDS_WRITTEN, BYTES_WRITTEN, FULL_WAITS, FULL_WAIT_NS, PID,
 PID_START, STATE, HEARTBEAT_NS) = range(9)
TAIL, RECORDS_READ = 16, 17

# Lane states (written by the producer).
FREE, ACTIVE, CLOSED = 0, 1, 2
STATE_NAMES = {FREE: "free", ACTIVE: "active", CLOSED: "closed"}

REC_MAGIC = 0x53414F52  # "SAOR"
WRAP_MAGIC = 0x53414F57  # "SAOW"
HDR = struct.Struct("<IIQQQ")  # magic, reserved, length, seq, checksum.
HEADER_BYTES = 32
assert HDR.size == HEADER_BYTES
checksum = xxhash.xxh3_64_intdigest  # Of one buffer.
TAG_BYTES = mac.TAG_BYTES  # The MAC trailer of a record in a keyed ring.


def checksum_parts(parts) -> int:
  """The checksum of the concatenation of ``parts`` (bytes-like)."""
  if len(parts) == 1:
    return checksum(parts[0])
  h = xxhash.xxh3_64()
  for p in parts:
    h.update(p)
  return h.intdigest()


class RingError(RuntimeError):
  """Base class of ring errors."""


class RingFullError(RingError, TimeoutError):
  """A producer's lane stayed full for the whole timeout."""


class RingEmptyError(RingError, TimeoutError):
  """Every lane stayed empty for the whole timeout."""


class RingDrained(RingError, EOFError):
  """Every producer has closed or died and all committed records were read."""


class RingClosedError(RingError):
  """The consumer closed the ring; producers must stop."""


class CorruptRecordError(RingError):
  """A committed record failed its magic/sequence/checksum check."""


class Record(NamedTuple):
  """One record as returned by ``RingReader.read``."""

  lane: int
  seq: int
  data: np.ndarray  # uint8[n], a private copy (safe to keep).


# Record(lane, seq, data) without the Python-level NamedTuple.__new__.
new_record = functools.partial(tuple.__new__, Record)


def proc_stat(pid: int) -> list[bytes] | None:
  """Fields of /proc/<pid>/stat after the command name; None if it is gone."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rsplit(b")", 1)[1].split()
  except OSError:
    return None


def proc_start_time(pid: int) -> int:
  """Process start time (clock ticks since boot); 0 if unknown."""
  fields = proc_stat(pid)
  return int(fields[19]) if fields else 0


def pid_alive(pid: int, start_time: int = 0) -> bool:
  """Whether ``pid`` runs (not a zombie) and, if given, started then."""
  if pid > 0 and not os.path.isdir("/proc"):  # Not Linux: signal 0 only.
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      pass
    return True
  fields = proc_stat(pid) if pid > 0 else None
  return (fields is not None and fields[0] not in (b"Z", b"X")
          and (not start_time or int(fields[19]) == start_time))


sched_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class Backoff:
  """Polling waits: ``sched_yield`` spins, then sleeps up to ``max_sleep``.

  ``time.sleep(0)`` is no yield on Linux/CPython: it sleeps for the timer
  slack (tens of µs), so the first waits only give up the core.
  """

  _SPINS = 64

  def __init__(self, max_sleep: float = 1e-3):
    self._n = 0
    self._max = max_sleep

  def wait(self) -> None:
    self._n += 1
    if self._n <= self._SPINS:
      sched_yield()
    else:
      time.sleep(min(self._max, 5e-5 * 2 ** min(self._n - self._SPINS, 10)))


def recopied(out: np.ndarray, src: memoryview, good: Callable[..., bool],
             tries: int) -> tuple[bool, int]:
  """(Whether ``good(out)``, re-copies made).

  While it is not, re-copies ``src`` into ``out`` 1 ms apart, up to ``tries``
  times: a record read before its producer's stores were visible (weakly
  ordered CPUs) turns good; a corrupted or forged one does not.
  """
  ok, n = good(out), 0
  while not ok and n < tries:
    n += 1
    time.sleep(1e-3)
    out[:] = src
    ok = good(out)
  return ok, n


def data_offset(num_lanes: int) -> int:
  return (GLOBAL_BYTES + num_lanes * CTL_BYTES + 4095) // 4096 * 4096


class Segment:
  """Typed views of a ring segment (shared by reader and writer)."""

  @classmethod
  def create(cls, num_lanes: int, lane_bytes: int,
             keyed: bool = False) -> Segment:
    """A new segment (owned: unlinked on close) of an empty ring."""
    if num_lanes < 1:
      raise ValueError(f"num_lanes must be >= 1, got {num_lanes}.")
    if lane_bytes < 4 * ALIGN or lane_bytes % ALIGN:
      raise ValueError(f"lane_bytes must be a multiple of {ALIGN} and >= "
                       f"{4 * ALIGN}, got {lane_bytes}.")
    shm = segment.create("ring",
                         data_offset(num_lanes) + num_lanes * lane_bytes)
    try:
      glob = shm.buf[:64].cast("Q")
      glob[G_LANES], glob[G_LANE_BYTES] = num_lanes, lane_bytes
      glob[G_KEYED] = int(keyed)
      glob[G_VERSION], glob[G_MAGIC] = LAYOUT_VERSION, MAGIC
      glob.release()
      return cls(shm, owner=True)
    except BaseException:
      segment.release(shm, unlink=True)
      raise

  def __init__(self, shm, owner: bool):
    self.shm, self.name, self.owner = shm, shm.name, owner
    buf = shm.buf
    # Memoryview counters: indexing yields Python ints (cheaper than NumPy
    # scalars on the per-record path); aligned 8-byte loads and stores.
    self.glob = buf[:64].cast("Q")
    if self.glob[G_MAGIC] != MAGIC:
      raise RingError(
          f"Segment {shm.name!r} is not a sao_jax ring (bad magic); pass the "
          "name returned by RingReader.create(...).name.")
    if self.glob[G_VERSION] != LAYOUT_VERSION:
      raise RingError(
          f"Ring {shm.name!r} has layout version {self.glob[G_VERSION]}, "
          f"this code reads {LAYOUT_VERSION}; run both sides from one "
          "checkout.")
    self.num_lanes = self.glob[G_LANES]
    self.lane_bytes = self.glob[G_LANE_BYTES]
    self.keyed = bool(self.glob[G_KEYED])
    self.ctl = [buf[GLOBAL_BYTES + i * CTL_BYTES:
                    GLOBAL_BYTES + (i + 1) * CTL_BYTES].cast("q")
                for i in range(self.num_lanes)]
    start = data_offset(self.num_lanes)
    self.lanes = [buf[start + i * self.lane_bytes:
                      start + (i + 1) * self.lane_bytes]
                  for i in range(self.num_lanes)]

  def claim_lane(self, lane: int, keyed: bool):
    """Makes this process ``lane``'s producer; returns its control words.

    The lane must be unused (lanes are never reused) and ``keyed`` must say
    whether the writer holds the key of an authenticated ring.
    """
    if not 0 <= lane < self.num_lanes:
      raise ValueError(f"lane {lane} out of range: ring {self.name} has "
                       f"{self.num_lanes} lanes.")
    if keyed != self.keyed:
      raise RingError(
          f"Ring {self.name} is {'' if self.keyed else 'not '}authenticated: "
          "pass key=RingReader.key of its creator exactly when it is.")
    ctl = self.ctl[lane]
    if ctl[STATE] != FREE:
      pid = ctl[PID]
      alive = pid_alive(pid, ctl[PID_START])
      raise RingError(
          f"Lane {lane} of ring {self.name} is held by "
          f"{'live' if alive else 'dead'} producer pid {pid} (lanes are not "
          "reused); give each producer process its own lane.")
    ctl[PID] = os.getpid()
    ctl[PID_START] = proc_start_time(os.getpid())
    ctl[HEARTBEAT_NS] = time.time_ns()
    ctl[STATE] = ACTIVE
    return ctl

  def find_dead(self, dead: dict[int, int]) -> None:
    """Adds to ``dead`` ({lane: pid}) the active lanes whose producer died."""
    for lane, ctl in enumerate(self.ctl):
      if ctl[STATE] != ACTIVE or lane in dead:
        continue
      pid = ctl[PID]
      if not pid_alive(pid, ctl[PID_START]):
        dead[lane] = pid
        logging.warning(
            "Ring %s: producer pid %d of lane %d died; %d committed records "
            "left to read, then the lane is skipped.", self.name, pid, lane,
            ctl[RECORDS_WRITTEN] - ctl[RECORDS_READ])

  def stats(self, dead: dict[int, int]) -> dict:
    """Every lane's counters (``dead`` lanes so marked) and their totals."""
    lanes = [self.lane_stats(lane) for lane in range(self.num_lanes)]
    for lane in dead:
      lanes[lane]["state"] = "dead"
    return {"records_read": sum(l["records_read"] for l in lanes),
            "occupancy": max(l["occupancy"] for l in lanes),
            "producer_deaths": len(dead), "dead_producers": sorted(dead),
            "lanes": lanes}

  def lane_stats(self, lane: int) -> dict:
    """The counters of one lane's control words."""
    c = self.ctl[lane]
    used = c[HEAD] - c[TAIL]
    return {
        "lane": lane, "state": STATE_NAMES[c[STATE]], "pid": c[PID],
        "occupancy_bytes": used, "occupancy": used / self.lane_bytes,
        "records_written": c[RECORDS_WRITTEN],
        "records_read": c[RECORDS_READ], "bytes_written": c[BYTES_WRITTEN],
        "full_waits": c[FULL_WAITS], "full_wait_s": c[FULL_WAIT_NS] / 1e9,
        # Seconds since the producer last wrote or waited for space: a live
        # but hung producer shows here, not as dead.
        "heartbeat_age_s": ((time.time_ns() - c[HEARTBEAT_NS]) / 1e9
                            if c[PID] else None),
    }

  def close(self) -> None:
    if self.shm is None:
      return
    views = [self.glob, *self.ctl, *self.lanes]
    self.glob = self.ctl = self.lanes = None
    for v in views:
      try:
        v.release()
      except BufferError:  # A caller still holds an array of this lane;
        pass  # segment.release() leaves the mapping to the last such view.
    segment.release(self.shm, unlink=self.owner)
    self.shm = None

  def __del__(self):
    if getattr(self, "shm", None) is not None:
      self.close()


def byte_view(buf) -> memoryview:
  """A flat byte view of a bytes-like object or array (copied only if it is
  not C-contiguous or has no native format)."""
  m = memoryview(buf)
  if m.format == "B" and m.ndim == 1 and m.c_contiguous:
    return m
  try:
    return m.cast("B")  # Any C-contiguous buffer of a native format.
  except TypeError:  # Non-contiguous, or e.g. a big-endian NumPy dtype.
    arr = np.ascontiguousarray(buf)
    return memoryview(arr.reshape(-1).view(np.uint8))
