"""A multi-producer single-consumer shared-memory ring of variable-size records.

The sampler processes publish trajectories here; the trainer reads them
(DESIGN.md §1). One segment holds one SPSC *lane* per producer:

    [global header 4 KiB][lane controls, 256 B each][lane 0 data][lane 1]...

Each lane is a byte ring with monotonic 64-bit ``head`` (written only by its
producer) and ``tail`` (written only by the consumer) counters; offsets are
``counter % lane_bytes``. A record is a 32-byte header (magic, length,
sequence number, checksum) followed by the payload, padded to 64 bytes, and
never split:
when it does not fit before the end of the lane the producer writes a *wrap*
marker and continues at offset 0.

Commit protocol (no torn reads): the producer copies the payload, then the
header, and only then advances ``head`` with one aligned 8-byte store. The
consumer never reads past ``head``, so a producer killed mid-write leaves
nothing visible. Every record also carries its per-lane sequence number and
a checksum of the payload, which the consumer verifies on what it returns (its
private copy, or the view for ``copy=False``):

* ``"xxh3"`` (default): XXH3-64 of the ``xxhash`` library, one pass at
  28-44 GB/s here (faster than a memcpy from L2 or L3). Changed, swapped,
  inserted or removed bytes alike go unnoticed only with probability
  ~2**-64 (it is not a cryptographic hash: no defence against an attacker).
* ``"crc32"`` (zlib, no extra library): every burst up to 32 bits; ~3 GB/s
  here, ~10x slower than memcpy.
* ``"none"``: headers (magic, sequence, length) are still validated.

BENCHMARKS.md has the costs.

Backpressure: a producer waits while its lane is full (first up to 64
``sched_yield`` calls, then sleeps doubling from 0.1 ms to 1 ms; never
``time.sleep(0)``, which sleeps ~60 µs of timer slack on Linux), and raises
``RingFullError`` after ``timeout``; the consumer waits the same way while
every lane is empty and raises ``RingEmptyError``. Waits, occupancy and
producer deaths are counted in ``stats()``. Each side keeps the last value
it read of the other side's counter and re-reads it (a cache line the other
core keeps writing) only when that value says the lane is full or empty.

Producer death: each lane stores its producer's pid and process start time;
the consumer checks them (``/proc``; zombies count as dead) while it is idle and
every ``liveness_interval_s``, keeps the records already committed, reports the
lane in ``dead_producers()`` and keeps reading the other lanes.

Payloads are copied by memoryview slice assignment (memcpy, ~1 µs less per
call than ``np.copyto``); nothing is pickled.
Memory ordering relies on the store order of x86-64 (TSO); on weakly ordered
CPUs a checksum mismatch is retried briefly before being reported as corruption.
"""

from __future__ import annotations

import functools
import os
import struct
import time
import zlib
from typing import Callable, Iterator, NamedTuple, Sequence

from absl import logging
import numpy as np
import xxhash

from sao_jax.ipc import segment

_MAGIC = 0x5A0_12196  # Segment layout magic.
_LAYOUT_VERSION = 2  # 2: checksum ids (none, xxh3, crc32).
_GLOBAL_BYTES = 4096
_CTL_BYTES = 256
_ALIGN = 64

# Global header words (uint64).
_G_MAGIC, _G_VERSION, _G_LANES, _G_LANE_BYTES, _G_CHECKSUM, _G_CLOSED = range(6)

# Lane control words (int64). Producer-written words come first; the consumer's
# words live in a separate cache line (word 16 = byte 128).
_HEAD = 0
_RECORDS_WRITTEN = 1
_BYTES_WRITTEN = 2
_FULL_WAITS = 3
_FULL_WAIT_NS = 4
_PID = 5
_PID_START = 6
_STATE = 7
_HEARTBEAT_NS = 8
_TAIL = 16
_RECORDS_READ = 17

# Lane states (written by the producer).
FREE, ACTIVE, CLOSED = 0, 1, 2
_STATE_NAMES = {FREE: "free", ACTIVE: "active", CLOSED: "closed"}

_DEFAULT = object()  # "Use the writer's default timeout."
_REC_MAGIC = 0x53414F52  # "SAOR"
_WRAP_MAGIC = 0x53414F57  # "SAOW"
_HDR = struct.Struct("<IIQQQ")  # magic, reserved, length, seq, checksum.
CHECKSUMS = ("none", "xxh3", "crc32")
HEADER_BYTES = 32
assert _HDR.size == HEADER_BYTES


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


# Record(lane, seq, data) without the Python-level NamedTuple.__new__ (~0.3
# µs of the per-record path).
_new_record = functools.partial(tuple.__new__, Record)


def _align(n: int) -> int:
  return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _proc_start_time(pid: int) -> int:
  """Process start time (clock ticks since boot) from /proc; 0 if unknown."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    return int(fields[19])
  except (OSError, IndexError, ValueError):
    return 0


def pid_alive(pid: int, start_time: int = 0) -> bool:
  """Whether ``pid`` runs (not a zombie) and, if given, started then."""
  if pid <= 0:
    return False
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
  except FileNotFoundError:
    return False
  except OSError:  # No /proc (not Linux): fall back to signal 0.
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return False
    except PermissionError:
      return True
    return True
  if fields[0] in (b"Z", b"X"):
    return False
  return not start_time or int(fields[19]) == start_time


class _Backoff:
  """Polling waits: ``sched_yield`` spins first, then sleeps up to ``max_sleep``.

  ``time.sleep(0)`` is no yield on Linux/CPython 3.11: it sleeps for the timer
  slack (~60 µs here), longer than moving a 1 MiB record, so the first waits
  only give up the core (a few µs when the other core is free).
  """

  _SPINS = 64

  def __init__(self, max_sleep: float = 1e-3):
    self._n = 0
    self._max = max_sleep

  def wait(self) -> None:
    self._n += 1
    if self._n <= self._SPINS:
      _sched_yield()
    else:
      time.sleep(min(self._max, 5e-5 * 2 ** min(self._n - self._SPINS, 10)))


_sched_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class _Segment:
  """Typed views of a ring segment (shared by reader and writer)."""

  def __init__(self, shm, owner: bool):
    self.shm = shm
    self.name = shm.name
    self.owner = owner
    buf = shm.buf
    # Counters are memoryviews: indexing yields Python ints, cheaper than
    # NumPy scalars on this per-record path. Aligned 8-byte loads and stores.
    self.glob = buf[:64].cast("Q")
    if int(self.glob[_G_MAGIC]) != _MAGIC:
      raise RingError(
          f"Segment {shm.name!r} is not a sao_jax ring (bad magic); pass the "
          "name returned by RingReader.create(...).name."
      )
    if int(self.glob[_G_VERSION]) != _LAYOUT_VERSION:
      raise RingError(
          f"Ring {shm.name!r} has layout version {int(self.glob[_G_VERSION])}, "
          f"this code reads {_LAYOUT_VERSION}; run both sides from one "
          "checkout."
      )
    self.num_lanes = int(self.glob[_G_LANES])
    self.lane_bytes = int(self.glob[_G_LANE_BYTES])
    self.checksum = CHECKSUMS[int(self.glob[_G_CHECKSUM])]
    self.ctl = [
        buf[_GLOBAL_BYTES + i * _CTL_BYTES:
            _GLOBAL_BYTES + (i + 1) * _CTL_BYTES].cast("q")
        for i in range(self.num_lanes)
    ]
    # One buffer / several buffers (their concatenation) -> checksum.
    self.check, self.check_parts = _CHECKSUM_FNS[self.checksum]
    data_off = _data_offset(self.num_lanes)
    starts = [data_off + i * self.lane_bytes for i in range(self.num_lanes)]
    # Per lane: a writable memoryview (copies, headers: cheapest per call),
    # a NumPy array (tests poke bytes through it) and a read-only NumPy view
    # whose slices are the records of ``read(copy=False)``.
    self.lanes = [buf[s:s + self.lane_bytes] for s in starts]
    self.data = [np.frombuffer(lane, np.uint8) for lane in self.lanes]
    self.rodata = [np.frombuffer(lane.toreadonly(), np.uint8)
                   for lane in self.lanes]
    self.buf = buf

  def close(self) -> None:
    if self.shm is None:
      return
    views = [self.glob, *self.ctl, *self.lanes]
    self.glob = self.ctl = self.data = self.rodata = self.lanes = None
    self.buf = None
    for v in views:
      try:
        v.release()
      except BufferError:  # A caller still holds an array of this lane;
        pass  # segment.release() leaves the mapping to the last such view.
    segment.release(self.shm, unlink=self.owner)
    self.shm = None

  def __del__(self):
    # Drop our NumPy views before SharedMemory.__del__ closes the mapping.
    if getattr(self, "shm", None) is not None:
      self.close()


def _data_offset(num_lanes: int) -> int:
  ctl_end = _GLOBAL_BYTES + num_lanes * _CTL_BYTES
  return (ctl_end + 4095) // 4096 * 4096


def segment_bytes(num_lanes: int, lane_bytes: int) -> int:
  """Total segment size for a ring of this shape."""
  return _data_offset(num_lanes) + num_lanes * lane_bytes


class RingReader:
  """The single consumer. ``create`` makes (and owns) the segment.

  Usage::

    with RingReader.create(num_lanes=2, lane_bytes=64 << 20) as ring:
      spawn producers with (ring.name, lane)...
      rec = ring.read(timeout=10.0)   # Record(lane, seq, data)
  """

  def __init__(self, seg: _Segment, liveness_interval_s: float = 0.2):
    self._seg = seg
    self._next_lane = 0
    self._liveness_interval = liveness_interval_s
    self._last_liveness = 0.0
    self._dead: dict[int, int] = {}
    self._deaths = 0
    self._empty_waits = 0
    self._empty_wait_ns = 0
    self._bytes_read = 0
    self._checksum_retries = 0
    self._pending = None  # (ctl, records_read, tail) of a read(copy=False).
    # Last ``head`` seen per lane: ``head`` is re-read (a cache line the
    # producer keeps writing) only once the records up to it are consumed.
    self._heads = [0] * seg.num_lanes

  @classmethod
  def create(
      cls,
      num_lanes: int,
      lane_bytes: int,
      *,
      checksum: str = "xxh3",
      liveness_interval_s: float = 0.2,
  ) -> RingReader:
    """Creates a ring with one lane per producer, each ``lane_bytes`` large.

    Args:
      num_lanes: Number of producer slots (one producer process each).
      lane_bytes: Bytes per lane; a record needs its payload + 32 bytes,
        rounded up to 64. Records larger than that are rejected.
      checksum: "xxh3", "crc32" or "none": the payload check each side
        computes (one extra pass over the bytes; see BENCHMARKS.md).
      liveness_interval_s: How often producer pids are checked.
    """
    if num_lanes < 1:
      raise ValueError(f"num_lanes must be >= 1, got {num_lanes}.")
    if checksum not in CHECKSUMS:
      raise ValueError(
          f"checksum must be one of {CHECKSUMS}, got {checksum!r}.")
    if lane_bytes < 4 * _ALIGN or lane_bytes % _ALIGN:
      raise ValueError(
          f"lane_bytes must be a multiple of {_ALIGN} and >= {4 * _ALIGN}, got "
          f"{lane_bytes}."
      )
    shm = segment.create("ring", segment_bytes(num_lanes, lane_bytes))
    try:
      glob = np.frombuffer(shm.buf, np.uint64, count=8)
      glob[_G_LANES] = num_lanes
      glob[_G_LANE_BYTES] = lane_bytes
      glob[_G_CHECKSUM] = CHECKSUMS.index(checksum)
      glob[_G_VERSION] = _LAYOUT_VERSION
      glob[_G_MAGIC] = _MAGIC
      del glob
      seg = _Segment(shm, owner=True)
    except BaseException:
      segment.release(shm, unlink=True)
      raise
    logging.info(
        "Created ring %s: %d lanes x %d bytes, checksum=%s.",
        shm.name, num_lanes, lane_bytes, checksum,
    )
    return cls(seg, liveness_interval_s)

  @classmethod
  def attach(cls, name: str, liveness_interval_s: float = 0.2) -> RingReader:
    """Consumes a ring created elsewhere (does not own the segment)."""
    return cls(_Segment(segment.attach(name), owner=False), liveness_interval_s)

  # --- properties -----------------------------------------------------------

  @property
  def name(self) -> str:
    return self._seg.name

  @property
  def num_lanes(self) -> int:
    return self._seg.num_lanes

  @property
  def lane_bytes(self) -> int:
    return self._seg.lane_bytes

  @property
  def max_record_bytes(self) -> int:
    return self._seg.lane_bytes - HEADER_BYTES

  # --- reading --------------------------------------------------------------

  def read(self, timeout: float | None = None, *, copy: bool = True) -> Record:
    """Returns the next committed record of some lane (round-robin).

    Args:
      timeout: Seconds to wait while every lane is empty; None waits forever.
      copy: If False, ``data`` is a read-only view into the ring (no copy),
        valid only until the next ``read`` or ``release()``, which free its
        space for the producer. Decode/copy what you need before then.

    Raises:
      RingEmptyError: nothing arrived within ``timeout``.
      RingDrained: every lane's producer closed or died, all records read.
      CorruptRecordError: a committed record failed validation.
    """
    if self._pending is not None:
      self.release()
    if time.monotonic() - self._last_liveness >= self._liveness_interval:
      self._check_liveness()
    rec = self._try_read(copy)
    if rec is not None:
      return rec
    t0 = time.monotonic_ns()
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = _Backoff()
    self._empty_waits += 1
    try:
      while True:
        rec = self._try_read(copy)
        if rec is not None:
          return rec
        now = time.monotonic()
        if now - self._last_liveness >= self._liveness_interval:
          self._check_liveness()
          if self._drained():
            raise RingDrained(
                f"Ring {self.name}: all {self.num_lanes} producers closed or "
                f"died (dead lanes: {sorted(self._dead)}); nothing left."
            )
        if deadline is not None and now >= deadline:
          raise RingEmptyError(
              f"Ring {self.name}: no record for {timeout:.3g} s from any of "
              f"{self.num_lanes} lanes (states {self._lane_states()}); are the "
              "producers running? Increase the timeout for slow samplers."
          )
        backoff.wait()
    finally:
      self._empty_wait_ns += time.monotonic_ns() - t0

  def __iter__(self) -> Iterator[Record]:
    """Yields records until every producer has closed or died."""
    while True:
      try:
        yield self.read()
      except RingDrained:
        return

  def release(self) -> None:
    """Frees the record last returned by ``read(copy=False)``."""
    if self._pending is not None:
      ctl, records_read, tail = self._pending
      self._pending = None
      ctl[_RECORDS_READ] = records_read
      ctl[_TAIL] = tail

  def _try_read(self, copy: bool) -> Record | None:
    n = self._seg.num_lanes
    if n == 1:
      return self._take(0, copy)
    for k in range(n):
      lane = (self._next_lane + k) % n
      rec = self._take(lane, copy)
      if rec is not None:
        self._next_lane = (lane + 1) % n
        return rec
    return None

  def _take(self, lane: int, copy: bool) -> Record | None:
    seg = self._seg
    ctl, mv, cap = seg.ctl[lane], seg.lanes[lane], seg.lane_bytes
    while True:
      tail = ctl[_TAIL]
      head = self._heads[lane]
      if head <= tail:
        head = self._heads[lane] = ctl[_HEAD]
        if head == tail:
          return None
      off = tail % cap
      magic, _, length, seq, check = _HDR.unpack_from(mv, off)
      if magic == _WRAP_MAGIC:
        ctl[_TAIL] = tail + (cap - off)
        continue
      expected_seq = ctl[_RECORDS_READ]
      new_tail = tail + ((HEADER_BYTES + length + _ALIGN - 1) & -_ALIGN)
      if (magic != _REC_MAGIC or seq != expected_seq or new_tail > head
          or new_tail - tail > cap - off):
        raise CorruptRecordError(
            f"Ring {self.name} lane {lane}: bad record header at counter "
            f"{tail} (magic {magic:#x}, seq {seq} expected {expected_seq}, "
            f"length {length}, committed {head - tail}). The segment was "
            "overwritten by something else; recreate the ring."
        )
      start = off + HEADER_BYTES
      if copy:
        out = np.array(mv[start:start + length])  # One memcpy, uint8.
      else:
        out = seg.rodata[lane][start:start + length]
      if seg.check(out) != check:
        out = self._recheck(lane, start, length, check, tail, copy)
      self._bytes_read += length
      if copy:
        ctl[_RECORDS_READ] = expected_seq + 1
        ctl[_TAIL] = new_tail
      else:
        self._pending = (ctl, expected_seq + 1, new_tail)
      return _new_record((lane, seq, out))

  def _recheck(self, lane, start, length, check, tail, copy) -> np.ndarray:
    """Re-reads a record whose checksum mismatched (weak memory ordering)."""
    data = self._seg.rodata[lane]
    out = np.empty(length, np.uint8) if copy else data[start:start + length]
    for _ in range(5):
      self._checksum_retries += 1
      time.sleep(1e-3)
      if copy:
        out[:] = data[start:start + length]
      if self._seg.check(out) == check:
        return out
    raise CorruptRecordError(
        f"Ring {self.name} lane {lane}: {self._seg.checksum} mismatch on the "
        f"committed record at counter {tail} ({length} bytes). Shared memory "
        "was corrupted or written outside the ring API."
    )

  # --- producer liveness ----------------------------------------------------

  def _check_liveness(self) -> None:
    self._last_liveness = time.monotonic()
    for lane, ctl in enumerate(self._seg.ctl):
      pid = int(ctl[_PID])
      if int(ctl[_STATE]) != ACTIVE:
        continue
      if self._dead.get(lane) == pid:
        continue
      if not pid_alive(pid, int(ctl[_PID_START])):
        self._dead[lane] = pid
        self._deaths += 1
        logging.warning(
            "Ring %s: producer pid %d of lane %d died; %d committed records "
            "left to read, then the lane is skipped.", self.name, pid, lane,
            int(ctl[_RECORDS_WRITTEN]) - int(ctl[_RECORDS_READ]),
        )
      elif lane in self._dead:  # A new producer took the lane over.
        del self._dead[lane]

  def dead_producers(self) -> dict[int, int]:
    """Lanes whose producer died without closing, as {lane: pid}."""
    self._check_liveness()
    return dict(self._dead)

  def _drained(self) -> bool:
    for lane, ctl in enumerate(self._seg.ctl):
      finished = int(ctl[_STATE]) == CLOSED or lane in self._dead
      if not finished or int(ctl[_HEAD]) != int(ctl[_TAIL]):
        return False
    return True

  def _lane_states(self) -> list[str]:
    return [
        "dead" if lane in self._dead else _STATE_NAMES.get(int(c[_STATE]), "?")
        for lane, c in enumerate(self._seg.ctl)
    ]

  # --- stats / lifetime -----------------------------------------------------

  def stats(self) -> dict:
    """Counters: per-lane occupancy and waits, consumer waits, deaths."""
    lanes = []
    states = self._lane_states()
    for lane, c in enumerate(self._seg.ctl):
      used = int(c[_HEAD]) - int(c[_TAIL])
      lanes.append({
          "lane": lane,
          "state": states[lane],
          "pid": int(c[_PID]),
          "occupancy_bytes": used,
          "occupancy": used / self.lane_bytes,
          "records_written": int(c[_RECORDS_WRITTEN]),
          "records_read": int(c[_RECORDS_READ]),
          "bytes_written": int(c[_BYTES_WRITTEN]),
          "full_waits": int(c[_FULL_WAITS]),
          "full_wait_s": int(c[_FULL_WAIT_NS]) / 1e9,
          # Seconds since the producer last wrote or waited for space: a live
          # but hung sampler shows here, not in dead_producers().
          "heartbeat_age_s": (time.time_ns() - c[_HEARTBEAT_NS]) / 1e9
                             if c[_PID] else None,
      })
    return {
        "records_read": sum(l["records_read"] for l in lanes),
        "bytes_read": self._bytes_read,
        "occupancy": max(l["occupancy"] for l in lanes),
        "empty_waits": self._empty_waits,
        "empty_wait_s": self._empty_wait_ns / 1e9,
        "producer_deaths": self._deaths,
        "dead_producers": sorted(self._dead),
        "checksum_retries": self._checksum_retries,
        "lanes": lanes,
    }

  def close(self) -> None:
    """Tells producers to stop; unlinks the segment if this reader made it."""
    if self._seg.shm is None:
      return
    self._pending = None
    self._seg.glob[_G_CLOSED] = 1
    self._seg.close()

  def __enter__(self) -> RingReader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class RingWriter:
  """The producer of one lane (one per producer process).

  Usage::

    with RingWriter(name, lane=i) as w:
      w.write(header_bytes, array1, array2)   # gathered into one record
  """

  def __init__(
      self,
      name: str,
      lane: int,
      *,
      timeout: float | None = 60.0,
      _mid_write_hook: Callable[[int, int], None] | None = None,
  ):
    """Attaches to ring ``name`` and claims ``lane``.

    Args:
      name: ``RingReader.name`` of the ring.
      lane: Lane index in [0, num_lanes), unique per live producer.
      timeout: Default seconds ``write`` waits for space (None: forever).
      _mid_write_hook: Test-only: called as hook(seq, nbytes) after half the
        payload is copied, before the commit.
    """
    self._seg = _Segment(segment.attach(name), owner=False)
    seg = self._seg
    if not 0 <= lane < seg.num_lanes:
      self._seg.close()
      raise ValueError(
          f"lane {lane} out of range: ring {name} has {seg.num_lanes} lanes."
      )
    ctl = seg.ctl[lane]
    pid = int(ctl[_PID])
    if (int(ctl[_STATE]) == ACTIVE and pid != os.getpid()
        and pid_alive(pid, int(ctl[_PID_START]))):
      self._seg.close()
      raise RingError(
          f"Lane {lane} of ring {name} is held by live producer pid {pid}; "
          "give each producer process its own lane."
      )
    self._lane = lane
    self._ctl = ctl
    self._mv = seg.lanes[lane]
    self._cap = seg.lane_bytes
    self._check = seg.check
    self._check_parts = seg.check_parts
    self._timeout = timeout
    self._hook = _mid_write_hook
    self._seq = self._next_seq()
    # Last ``tail`` seen: re-read (the consumer's cache line) only when the
    # lane looks full with it, so most writes touch no consumer-written line.
    self._tail = ctl[_TAIL]
    ctl[_RECORDS_WRITTEN] = self._seq
    ctl[_PID] = os.getpid()
    ctl[_PID_START] = _proc_start_time(os.getpid())
    ctl[_HEARTBEAT_NS] = time.time_ns()
    ctl[_STATE] = ACTIVE

  def _next_seq(self) -> int:
    """Sequence number of the next record, from the committed data itself.

    A producer that took over the lane of a dead one cannot trust the dead
    one's counters (it may have died between commit and bookkeeping), so it
    walks the committed, unread records: the last one's seq + 1, or the
    consumer's next expected seq when there are none.
    """
    ctl, cap, mv = self._ctl, self._seg.lane_bytes, self._mv
    head = ctl[_HEAD]
    tail = ctl[_TAIL]
    expected = ctl[_RECORDS_READ]  # Written by the consumer before _TAIL.
    # [tail, head) stays intact while we walk it: only this (new) producer
    # writes record bytes, and it has not started yet.
    pos, last = tail, None
    while pos < head:
      off = pos % cap
      magic, _, length, seq, _ = _HDR.unpack_from(mv, off)
      if magic == _WRAP_MAGIC:
        pos += cap - off
        continue
      if magic != _REC_MAGIC:
        raise CorruptRecordError(
            f"Lane {self._lane} of ring {self._seg.name}: bad committed "
            f"record header at counter {pos}; recreate the ring.")
      last = seq
      pos += _align(HEADER_BYTES + length)
    return expected if last is None else last + 1

  @property
  def lane(self) -> int:
    return self._lane

  @property
  def max_record_bytes(self) -> int:
    return self._seg.lane_bytes - HEADER_BYTES

  def write(self, *buffers, timeout=_DEFAULT) -> int:
    """Appends one record: the concatenation of ``buffers`` (bytes-like).

    Blocks while the lane is full. Returns the record's sequence number.

    Raises:
      ValueError: the record can never fit in the lane.
      RingFullError: no space within ``timeout`` (default: the writer's).
      RingClosedError: the consumer closed the ring.
    """
    mv = self._mv
    if mv is None:
      raise RingClosedError("write() on a closed RingWriter.")
    if len(buffers) == 1:
      parts = (_byte_view(buffers[0]),)
      n = parts[0].nbytes
    else:
      parts = [_byte_view(b) for b in buffers]
      n = sum(p.nbytes for p in parts)
    need = (HEADER_BYTES + n + _ALIGN - 1) & -_ALIGN
    ctl, cap = self._ctl, self._cap
    if need > cap:
      raise ValueError(
          f"Record of {n} bytes does not fit in a lane of {cap} bytes (needs "
          f"{need} with header and padding; max payload {cap - HEADER_BYTES}). "
          "Create the ring with a larger lane_bytes or send smaller records."
      )
    head = ctl[_HEAD]
    off = head % cap
    if need > cap - off or cap - (head - self._tail) < need:  # Slow path.
      if timeout is _DEFAULT:
        timeout = self._timeout
      off = self._reserve(head, need, timeout)
      if off < 0:  # Wrapped: marker written, head moved to the lane start.
        head = ctl[_HEAD]
        off = self._reserve(head, need, timeout)
    seq = self._seq
    start = off + HEADER_BYTES
    # The checksum is of the bytes as sent (the source, hot in this core's
    # cache), so the consumer's check also covers the copy into the lane.
    if len(parts) == 1:
      check = self._check(parts[0])
    else:
      check = self._check_parts(parts)
    if self._hook is not None:
      self._copy_in(start, parts, n, seq)
    elif len(parts) == 1:
      mv[start:start + n] = parts[0]
    else:
      pos = start
      for p in parts:
        mv[pos:pos + p.nbytes] = p
        pos += p.nbytes
    _HDR.pack_into(mv, off, _REC_MAGIC, 0, n, seq, check)
    ctl[_HEAD] = head + need  # The commit.
    self._seq = seq + 1
    ctl[_RECORDS_WRITTEN] = seq + 1  # Bookkeeping for stats only.
    ctl[_BYTES_WRITTEN] += n
    ctl[_HEARTBEAT_NS] = time.time_ns()
    return seq

  def _reserve(self, head: int, need: int, timeout: float | None) -> int:
    """Waits for ``need`` contiguous bytes; returns offset, or -1 if wrapped."""
    ctl, cap = self._ctl, self._seg.lane_bytes
    off = head % cap
    contiguous = cap - off
    want = need if need <= contiguous else contiguous
    self._tail = ctl[_TAIL]
    if cap - (head - self._tail) < want:
      self._wait_space(head, want, timeout)
    if need <= contiguous:
      return off
    _HDR.pack_into(self._mv, off, _WRAP_MAGIC, 0, 0, 0, 0)
    ctl[_HEAD] = head + contiguous
    return -1

  def _wait_space(self, head: int, want: int, timeout: float | None) -> None:
    ctl, cap, glob = self._ctl, self._seg.lane_bytes, self._seg.glob
    t0 = time.monotonic_ns()
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = _Backoff()
    try:
      while cap - (head - int(ctl[_TAIL])) < want:
        if int(glob[_G_CLOSED]):
          raise RingClosedError(
              f"Ring {self._seg.name} was closed by its consumer; stop "
              "producing."
          )
        if deadline is not None and time.monotonic() >= deadline:
          raise RingFullError(
              f"Lane {self._lane} of ring {self._seg.name} stayed full for "
              f"{timeout:.3g} s ({head - int(ctl[_TAIL])}/{cap} bytes used, "
              f"need {want}); the consumer is not reading. Check the trainer "
              "or raise lane_bytes/timeout."
          )
        ctl[_HEARTBEAT_NS] = time.time_ns()
        backoff.wait()
      self._tail = ctl[_TAIL]
    finally:
      ctl[_FULL_WAITS] += 1
      ctl[_FULL_WAIT_NS] += time.monotonic_ns() - t0

  def _copy_in(self, start: int, parts: Sequence[memoryview], n: int,
               seq: int) -> None:
    """The copy of the test hook: pauses in ``_mid_write_hook`` half-way."""
    mv = self._mv
    pos = start
    half = start + n // 2
    for p in parts:
      end = pos + p.nbytes
      if pos <= half < end:
        k = half - pos
        mv[pos:half] = p[:k]
        self._hook(seq, n)
        mv[half:end] = p[k:]
      else:
        mv[pos:end] = p
      pos = end

  def stats(self) -> dict:
    c = self._ctl
    return {
        "lane": self._lane,
        "records_written": int(c[_RECORDS_WRITTEN]),
        "bytes_written": int(c[_BYTES_WRITTEN]),
        "occupancy_bytes": int(c[_HEAD]) - int(c[_TAIL]),
        "full_waits": int(c[_FULL_WAITS]),
        "full_wait_s": int(c[_FULL_WAIT_NS]) / 1e9,
    }

  def close(self) -> None:
    """Marks the lane closed (no more records) and detaches."""
    if self._seg.shm is None:
      return
    self._ctl[_STATE] = CLOSED
    self._ctl = self._mv = None
    self._seg.close()

  def __enter__(self) -> RingWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _xxh3_parts(parts: Sequence[memoryview]) -> int:
  h = xxhash.xxh3_64()
  for p in parts:
    h.update(p)
  return h.intdigest()


def _crc32_parts(parts: Sequence[memoryview]) -> int:
  c = 0
  for p in parts:
    c = zlib.crc32(p, c)
  return c


_CHECKSUM_FNS = {  # name: (of one buffer, of several concatenated)
    "none": (lambda b: 0, lambda parts: 0),
    "xxh3": (xxhash.xxh3_64_intdigest, _xxh3_parts),
    "crc32": (zlib.crc32, _crc32_parts),
}


def _byte_view(buf) -> memoryview:
  """A flat byte memoryview of a bytes-like object or array (no copy if
  C-contiguous; others are copied once)."""
  m = memoryview(buf)
  if m.format == "B" and m.ndim == 1 and m.c_contiguous:
    return m
  try:
    return m.cast("B")  # Any C-contiguous buffer of a native format.
  except TypeError:  # Non-contiguous, or e.g. a big-endian NumPy dtype.
    arr = np.ascontiguousarray(buf)
    return memoryview(arr.reshape(-1).view(np.uint8))
