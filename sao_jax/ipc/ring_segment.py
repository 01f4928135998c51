"""The trajectory ring's segment: layout, lifetime, producers, counters.

Everything of the ring that no record passes through (docs/design/ipc.md
"Trajectory ring"): the segment layout and its typed views, creating and
attaching it, a producer claiming its lane and waiting for space, the reader's
bookkeeping (producer liveness from ``/proc``, waits on an empty ring, the
counters ``stats`` reports), the ring's errors and the polling backoff. The
records themselves (header, checksum or MAC, the copies in and out) are
``sao_jax.ipc.ring``.

    [global header 4 KiB][lane controls, 256 B each][lane 0 data][lane 1]...

Each lane is a byte ring with monotonic 64-bit ``head`` (written only by its
producer) and ``tail`` (written only by the consumer) counters; offsets are
``counter % lane_bytes``, and records are padded to ``ALIGN`` bytes. The
part of the ring's fault model that lives here:

* Producer death (pid and start time in ``/proc``, zombies dead): committed
  records are still read, then the lane is skipped; the lane is reported in
  ``RingReader.dead_producers()``.
* Backpressure: ``RingFullError`` / ``RingEmptyError`` after ``timeout``;
  waits are counted in ``stats()``.
"""

from __future__ import annotations

import abc
import os
import time
from typing import Self

from absl import logging

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


def data_offset(num_lanes: int) -> int:
  return (GLOBAL_BYTES + num_lanes * CTL_BYTES + 4095) // 4096 * 4096


class Segment:
  """Typed views of a ring segment (shared by reader and writer)."""

  @classmethod
  def create(cls, num_lanes: int, lane_bytes: int,
             keyed: bool = False) -> Segment:
    """A new segment (owned: unlinked on close) of an empty ring.

    Args:
      num_lanes: Number of producers (one process each).
      lane_bytes: Bytes per lane, a multiple of ``ALIGN``; a record needs its
        payload + 32 bytes (+ 16 keyed), rounded up to ``ALIGN``. Larger
        records are rejected.
      keyed: Records carry a MAC (``G_KEYED``).
    """
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
      seg = cls(shm, owner=True)
    except BaseException:
      segment.release(shm, unlink=True)
      raise
    logging.info("Created ring %s: %d lanes x %d bytes%s.", seg.name,
                 num_lanes, lane_bytes, ", authenticated" * keyed)
    return seg

  @classmethod
  def attach(cls, name: str) -> Segment:
    """The existing segment ``name`` (not owned)."""
    return cls(segment.attach(name), owner=False)

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
    whether the writer holds the key of an authenticated ring; if not, the
    segment is closed and the error raised.
    """
    try:
      return self._claim(lane, keyed)
    except BaseException:
      self.close()
      raise

  def _claim(self, lane: int, keyed: bool):
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

  def wait_space(self, lane: int, head: int, want: int,
                 timeout: float | None) -> int:
    """Waits until ``lane`` (its producer at ``head``) has ``want`` free
    bytes, counting the wait; returns the consumer's ``tail``.

    Raises:
      RingClosedError: the consumer closed the ring.
      RingFullError: no space within ``timeout`` (None: waits forever).
    """
    ctl, cap, glob = self.ctl[lane], self.lane_bytes, self.glob
    t0 = time.monotonic_ns()
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = Backoff()
    try:
      while cap - (head - ctl[TAIL]) < want:
        if glob[G_CLOSED]:
          raise RingClosedError(
              f"Ring {self.name} was closed by its consumer; stop producing.")
        if deadline is not None and time.monotonic() >= deadline:
          raise RingFullError(
              f"Lane {lane} of ring {self.name} stayed full for "
              f"{timeout:.3g} s ({head - ctl[TAIL]}/{cap} bytes used, "
              f"need {want}); the consumer is not reading. Check the trainer "
              "or raise lane_bytes/timeout.")
        ctl[HEARTBEAT_NS] = time.time_ns()
        backoff.wait()
      return ctl[TAIL]
    finally:
      ctl[FULL_WAITS] += 1
      ctl[FULL_WAIT_NS] += time.monotonic_ns() - t0

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


class ReaderBook:
  """The reader's bookkeeping, apart from its records: which producers died
  (pid and start time in ``/proc``, zombies dead; checked at most every
  ``interval_s``), whether the ring is drained, its waits on an empty ring
  and its counters (``stats``)."""

  def __init__(self, seg: Segment, interval_s: float):
    self._seg, self._interval = seg, interval_s
    self.next_check = 0.0  # time.monotonic() of the next liveness check.
    self.dead: dict[int, int] = {}  # {lane: pid} of producers that died.
    self.empty_waits = self.empty_wait_ns = 0
    self.bytes_read = self.checksum_retries = self.rejected = 0

  def poll(self) -> bool:
    """Checks liveness if ``interval_s`` has passed; whether it did."""
    if time.monotonic() < self.next_check:
      return False
    self.check()
    return True

  def check(self) -> None:
    """Adds the active lanes whose producer died to ``dead``."""
    self.next_check = time.monotonic() + self._interval
    for lane, ctl in enumerate(self._seg.ctl):
      if ctl[STATE] != ACTIVE or lane in self.dead:
        continue
      pid = ctl[PID]
      if not pid_alive(pid, ctl[PID_START]):
        self.dead[lane] = pid
        logging.warning(
            "Ring %s: producer pid %d of lane %d died; %d committed records "
            "left to read, then the lane is skipped.", self._seg.name, pid,
            lane, ctl[RECORDS_WRITTEN] - ctl[RECORDS_READ])

  def idle(self, deadline: float | None, timeout: float | None,
           backoff: Backoff) -> None:
    """One wait of a reader that found every lane empty.

    Raises:
      RingDrained: every producer closed or died and its lane is empty.
      RingEmptyError: ``deadline`` (``timeout`` from the first wait) passed.
    """
    seg = self._seg
    if self.poll() and all(
        (c[STATE] == CLOSED or lane in self.dead) and c[HEAD] == c[TAIL]
        for lane, c in enumerate(seg.ctl)):
      raise RingDrained(
          f"Ring {seg.name}: all {seg.num_lanes} producers closed or died "
          f"(dead lanes: {sorted(self.dead)}); nothing left.")
    if deadline is not None and time.monotonic() >= deadline:
      states = [l["state"] for l in seg.stats(self.dead)["lanes"]]
      raise RingEmptyError(
          f"Ring {seg.name}: no record for {timeout:.3g} s from any of "
          f"{seg.num_lanes} lanes (states {states}); are the producers "
          "running? Increase the timeout for slow samplers.")
    backoff.wait()

  def reject(self, lane: int, tail: int, seq: int, nbytes: int,
             why: str) -> None:
    """Counts and logs a record of a keyed ring that failed its MAC or
    replayed an older sequence number (skipped by the reader)."""
    self.rejected += 1
    logging.warning(
        "Ring %s lane %d: skipped the record at counter %d (seq %d, %d bytes),"
        " %s (%d rejected so far): another process wrote the ring.",
        self._seg.name, lane, tail, seq, nbytes, why, self.rejected)

  def stats(self) -> dict:
    """Counters: per-lane occupancy and waits, consumer waits, deaths."""
    return {
        **self._seg.stats(self.dead), "bytes_read": self.bytes_read,
        "empty_waits": self.empty_waits,
        "empty_wait_s": self.empty_wait_ns / 1e9,
        "checksum_retries": self.checksum_retries,
        "rejected_records": self.rejected,
    }


class RingEnd(abc.ABC):
  """A ring's reader or writer: its segment's name and sizes, and ``close``
  on leaving a ``with`` block."""

  _seg: Segment

  @property
  def name(self) -> str:
    return self._seg.name

  @property
  def num_lanes(self) -> int:
    return self._seg.num_lanes

  @property
  def lane_bytes(self) -> int:
    return self._seg.lane_bytes

  @abc.abstractmethod
  def close(self) -> None:
    """Detaches from the segment (the reader also closes the ring)."""

  def __enter__(self) -> Self:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
