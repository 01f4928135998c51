"""A shared-memory ring of variable-size records, one lane per producer.

The sampler processes publish trajectories here and the trainer reads them
(docs/design/ipc.md "Trajectory ring"). One segment holds one single-producer
lane per sampler, a byte ring of records; the segment (layout, lanes, producer
liveness, counters, errors) is ``sao_jax.ipc.ring_segment``, and this module is
what each record's bytes pass through: the record's framing, its checksum or
MAC, and the copies into and out of the lane.

A record is a 32-byte header (magic, length, sequence number, XXH3-64 of the
payload, 0 in a keyed ring) followed by the payload and, in a keyed ring, its
16-byte MAC, padded to 64 bytes and never split: when it does not fit before
the end of the lane the producer writes a *wrap* marker and continues at
offset 0. Fault model:

* No torn reads: payload, then header, then ``head`` advanced by one aligned
  8-byte store; a producer killed mid-write leaves nothing visible.
* Corruption: magic, per-lane sequence number, length and the XXH3-64
  checksum of the consumer's private copy are checked (no defence against
  an attacker).
* Writes by other processes (``create(authenticate=True)``): a 16-byte MAC of
  payload, lane and sequence number under a key never in shared memory; a
  record failing it, or replaying an older sequence number, is skipped and
  counted (``rejected_records``), so a forgery never shifts genuine records.
* Producer death and backpressure: see ``ring_segment``.

Memory ordering relies on the store order of x86-64 (TSO); on weakly ordered
CPUs a checksum mismatch is retried briefly before being reported.
"""

from __future__ import annotations

import functools
import struct
import time
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np
import xxhash

from sao_jax.ipc import mac as mac_lib
from sao_jax.ipc import ring_segment as seg_lib

# The ring's errors, defined with the segment that raises most of them.
(RingError, RingFullError, RingEmptyError, RingDrained, RingClosedError,
 CorruptRecordError) = (
     seg_lib.RingError, seg_lib.RingFullError, seg_lib.RingEmptyError,
     seg_lib.RingDrained, seg_lib.RingClosedError, seg_lib.CorruptRecordError)
_DEFAULT = object()  # "Use the writer's default timeout."

REC_MAGIC = 0x53414F52  # "SAOR"
WRAP_MAGIC = 0x53414F57  # "SAOW"
HDR = struct.Struct("<IIQQQ")  # magic, reserved, length, seq, checksum.
HEADER_BYTES = 32
assert HDR.size == HEADER_BYTES
checksum = xxhash.xxh3_64_intdigest  # Of one buffer.
TAG_BYTES = mac_lib.TAG_BYTES  # The MAC trailer of a record in a keyed ring.

# The segment's words used on every record, bound once: a global lookup
# costs less than a module attribute lookup on this per-record path.
(_HEAD, _TAIL, _RECORDS_READ, _RECORDS_WRITTEN, _BYTES_WRITTEN,
 _HEARTBEAT_NS, _ALIGN) = (seg_lib.HEAD, seg_lib.TAIL, seg_lib.RECORDS_READ,
                           seg_lib.RECORDS_WRITTEN, seg_lib.BYTES_WRITTEN,
                           seg_lib.HEARTBEAT_NS, seg_lib.ALIGN)


class Record(NamedTuple):
  """One record as returned by ``RingReader.read``."""

  lane: int
  seq: int
  data: np.ndarray  # uint8[n], a private copy (safe to keep).


# Record(lane, seq, data) without the Python-level NamedTuple.__new__.
_new_record = functools.partial(tuple.__new__, Record)


def checksum_parts(parts) -> int:
  """The checksum of the concatenation of ``parts`` (bytes-like)."""
  if len(parts) == 1:
    return checksum(parts[0])
  h = xxhash.xxh3_64()
  for p in parts:
    h.update(p)
  return h.intdigest()


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


class RingReader(seg_lib.RingEnd):
  """The single consumer. ``create`` makes (and owns) the segment.

  Usage::

    with RingReader.create(num_lanes=1, lane_bytes=64 << 20) as ring:
      start producers with (ring.name, lane)...
      rec = ring.read(timeout=10.0)   # Record(lane, seq, data)
  """

  def __init__(self, seg: seg_lib.Segment, liveness_interval_s: float = 0.2,
               key: bytes | None = None):
    self._seg = seg
    self._next_lane = 0
    self._book = seg_lib.ReaderBook(seg, liveness_interval_s)
    # Last ``head`` seen per lane: re-read (a cache line the producer keeps
    # writing) only once the records up to it are consumed.
    self._heads = [0] * seg.num_lanes
    self._key = key
    self._mac = mac_lib.Mac(key) if key is not None else None
    self._overhead = HEADER_BYTES + (TAG_BYTES if key else 0)
    self._next_seq = [0] * seg.num_lanes  # Keyed: newest accepted + 1.

  @classmethod
  def create(cls, num_lanes: int, lane_bytes: int, *,
             liveness_interval_s: float = 0.2,
             authenticate: bool = False) -> RingReader:
    """A new ring (``Segment.create``), its producers' pids checked every
    ``liveness_interval_s``; ``authenticate``: records carry a MAC under a
    fresh secret ``key`` (``os.urandom``), which producers must be given."""
    seg = seg_lib.Segment.create(num_lanes, lane_bytes, keyed=authenticate)
    key = mac_lib.new_key() if authenticate else None
    return cls(seg, liveness_interval_s, key)

  @property
  def key(self) -> bytes | None:
    """The MAC key to hand to producers (never stored in shared memory)."""
    return self._key

  def read(self, timeout: float | None = None) -> Record:
    """Returns a private copy of the next committed record (lanes in turn).

    Args:
      timeout: Seconds to wait while every lane is empty; None waits forever.

    Raises:
      RingEmptyError: nothing arrived within ``timeout``.
      RingDrained: every lane's producer closed or died, all records read.
      CorruptRecordError: a committed record failed validation (in a keyed
        ring: its header cannot be framed; a bad MAC is only rejected).
    """
    book = self._book
    if time.monotonic() >= book.next_check:  # Inline: once per record.
      book.check()
    rec = self._try_read()
    if rec is not None:
      return rec
    t0 = time.monotonic_ns()
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = seg_lib.Backoff()
    book.empty_waits += 1
    try:
      while (rec := self._try_read()) is None:
        book.idle(deadline, timeout, backoff)
      return rec
    finally:
      book.empty_wait_ns += time.monotonic_ns() - t0

  def __iter__(self) -> Iterator[Record]:
    """Yields records until every producer has closed or died."""
    while True:
      try:
        yield self.read()
      except RingDrained:
        return

  def _try_read(self) -> Record | None:
    n = self._seg.num_lanes
    if n == 1:
      return self._take(0)
    for k in range(n):
      lane = (self._next_lane + k) % n
      rec = self._take(lane)
      if rec is not None:
        self._next_lane = (lane + 1) % n
        return rec
    return None

  def _take(self, lane: int) -> Record | None:
    seg, mac = self._seg, self._mac
    ctl, mv, cap = seg.ctl[lane], seg.lanes[lane], seg.lane_bytes
    while True:
      tail = ctl[_TAIL]
      head = self._heads[lane]
      if head <= tail:
        head = self._heads[lane] = ctl[_HEAD]
        if head == tail:
          return None
      off = tail % cap
      magic, _, length, seq, check = HDR.unpack_from(mv, off)
      if magic == WRAP_MAGIC:
        ctl[_TAIL] = tail + (cap - off)
        continue
      expected_seq = (ctl[_RECORDS_READ] if mac is None
                      else self._next_seq[lane])
      new_tail = tail + ((self._overhead + length + _ALIGN - 1) & -_ALIGN)
      if (magic != REC_MAGIC or (seq != expected_seq and mac is None)
          or new_tail > head or new_tail - tail > cap - off):
        raise CorruptRecordError(
            f"Ring {self.name} lane {lane}: bad record header at counter "
            f"{tail} (magic {magic:#x}, seq {seq} expected {expected_seq}, "
            f"length {length}, committed {head - tail}). The segment was "
            "overwritten by something else; recreate the ring.")
      start = off + HEADER_BYTES
      out = np.array(mv[start:start + length])  # One memcpy, uint8.
      if mac is not None:
        end = start + length
        tag = mv[end:end + TAG_BYTES].tobytes()
        if not (seq >= expected_seq and mac.verify(lane, seq, out, tag)
                or self._authentic(out, mv[start:end], lane, seq, tag, tail,
                                   expected_seq)):
          ctl[_TAIL] = new_tail  # Rejected: skipped, counted.
          continue
        self._next_seq[lane] = seq + 1
        ctl[_RECORDS_READ] += 1
      else:
        if checksum(out) != check and not self._recheck(
            out, mv[start:start + length], check):
          raise CorruptRecordError(
              f"Ring {self.name} lane {lane}: xxh3 mismatch on the committed "
              f"record at counter {tail} ({length} bytes). Shared memory was "
              "corrupted or written outside the ring API.")
        ctl[_RECORDS_READ] = expected_seq + 1
      self._book.bytes_read += length
      ctl[_TAIL] = new_tail
      return _new_record((lane, seq, out))

  def _recheck(self, out: np.ndarray, src: memoryview, check: int) -> bool:
    ok, retries = recopied(out, src, lambda o: checksum(o) == check, 5)
    self._book.checksum_retries += retries
    return ok

  def _authentic(self, out: np.ndarray, src: memoryview, lane: int, seq: int,
                 tag: bytes, tail: int, expected_seq: int) -> bool:
    """Whether a keyed ring's record that failed the first check is genuine
    and newer after re-copies (weak memory ordering); counts rejects."""
    ok, retries = recopied(out, src, lambda o: self._mac.verify(
        lane, seq, o, tag), 3)
    self._book.checksum_retries += retries
    if ok and seq >= expected_seq:
      return True
    self._book.reject(lane, tail, seq, out.nbytes, "a replay" if ok
                      else "bad MAC")
    return False

  def dead_producers(self) -> dict[int, int]:
    """Lanes whose producer died without closing, as {lane: pid}."""
    self._book.check()
    return dict(self._book.dead)

  def stats(self) -> dict:
    """Counters: per-lane occupancy and waits, consumer waits, deaths."""
    return self._book.stats()

  def close(self) -> None:
    """Tells producers to stop; unlinks the segment if this reader made it."""
    if self._seg.shm is None:
      return
    self._seg.glob[seg_lib.G_CLOSED] = 1
    self._seg.close()


class RingWriter(seg_lib.RingEnd):
  """The producer of one lane (one per producer process).

  Usage::

    with RingWriter(name, lane=i) as w:
      w.write(header_bytes, array1, array2)   # gathered into one record
  """

  def __init__(self, name: str, lane: int, *, timeout: float | None = 60.0,
               key: bytes | None = None):
    """Attaches to ring ``name`` and claims ``lane``, which must be unused.

    Args:
      name: ``RingReader.name`` of the ring.
      lane: Lane index in [0, num_lanes), one per producer process.
      timeout: Default seconds ``write`` waits for space (None: forever).
      key: ``RingReader.key`` of an authenticated ring (None otherwise).
    """
    seg = self._seg = seg_lib.Segment.attach(name)
    ctl = seg.claim_lane(lane, key is not None)  # Or detaches and raises.
    self._lane, self._ctl, self._mv = lane, ctl, seg.lanes[lane]
    self._cap = seg.lane_bytes
    self._timeout = timeout
    self._mac = mac_lib.Mac(key) if key is not None else None
    self._overhead = HEADER_BYTES + (TAG_BYTES if key else 0)
    self._seq = 0
    # Last ``tail`` seen: re-read (the consumer's cache line) only when the
    # lane looks full with it, so most writes touch no consumer-written line.
    self._tail = 0

  @property
  def lane(self) -> int:
    return self._lane

  def write(self, *buffers, timeout=_DEFAULT) -> int:
    """Appends one record: the concatenation of ``buffers`` (bytes-like).

    Blocks while the lane is full. Returns the record's sequence number.

    Raises:
      ValueError: the record can never fit in the lane.
      RingFullError: no space within ``timeout`` (default: the writer's).
      RingClosedError: the consumer closed the ring.
    """
    if self._mv is None:
      raise RingClosedError("write() on a closed RingWriter.")
    if len(buffers) == 1:
      parts = (byte_view(buffers[0]),)
      n = parts[0].nbytes
    else:
      parts = [byte_view(b) for b in buffers]
      n = sum(p.nbytes for p in parts)
    need = (self._overhead + n + _ALIGN - 1) & -_ALIGN
    ctl, cap = self._ctl, self._cap
    if need > cap:
      raise ValueError(
          f"Record of {n} bytes does not fit in a lane of {cap} bytes (needs "
          f"{need} with header and padding; max payload "
          f"{cap - self._overhead}). "
          "Create the ring with a larger lane_bytes or send smaller records.")
    head = ctl[_HEAD]
    off = head % cap
    if need > cap - off or cap - (head - self._tail) < need:  # Slow path.
      if timeout is _DEFAULT:
        timeout = self._timeout
      off = self._reserve(head, need, timeout)
      if off < 0:  # Wrapped: marker written, head moved to the lane start.
        head = ctl[_HEAD]
        off = self._reserve(head, need, timeout)
    seq, start = self._seq, off + HEADER_BYTES
    if self._mac is None:
      # The checksum is of the bytes as sent (hot in this core's cache), so
      # the consumer's check also covers the copy into the lane.
      check = (checksum(parts[0]) if len(parts) == 1
               else checksum_parts(parts))
      self._copy_in(start, parts, n)
    else:  # The MAC of the lane's copy (hot in cache), as a trailer.
      check = 0
      self._copy_in(start, parts, n)
      mv = self._mv
      mv[start + n:start + n + TAG_BYTES] = self._mac.tag(
          self._lane, seq, mv[start:start + n])
    HDR.pack_into(self._mv, off, REC_MAGIC, 0, n, seq, check)
    ctl[_HEAD] = head + need  # The commit.
    self._seq = seq + 1
    ctl[_RECORDS_WRITTEN] = seq + 1  # Bookkeeping for stats only.
    ctl[_BYTES_WRITTEN] += n
    ctl[_HEARTBEAT_NS] = time.time_ns()
    return seq

  def _copy_in(self, start: int, parts: Sequence[memoryview], n: int) -> None:
    """Copies the payload into the lane (tests replace this to fail mid-way)."""
    del n  # Used by the fault-injecting replacement in tests/ipc/test_ring.py.
    mv = self._mv
    for p in parts:
      mv[start:start + p.nbytes] = p
      start += p.nbytes

  def _reserve(self, head: int, need: int, timeout: float | None) -> int:
    """Waits for ``need`` contiguous bytes; returns offset, or -1 if wrapped."""
    cap = self._cap
    off = head % cap
    contiguous = cap - off
    want = min(need, contiguous)
    self._tail = self._ctl[_TAIL]
    if cap - (head - self._tail) < want:
      self._tail = self._seg.wait_space(self._lane, head, want, timeout)
    if need <= contiguous:
      return off
    HDR.pack_into(self._mv, off, WRAP_MAGIC, 0, 0, 0, 0)
    self._ctl[_HEAD] = head + contiguous
    return -1

  def close(self) -> None:
    """Marks the lane closed (no more records) and detaches."""
    if self._seg.shm is None:
      return
    self._ctl[seg_lib.STATE] = seg_lib.CLOSED
    self._ctl = self._mv = None
    self._seg.close()
