"""A shared-memory ring of variable-size records, one lane per producer.

The sampler processes publish trajectories here and the trainer reads them
(docs/DESIGN.md §1). One segment holds one single-producer lane per sampler,
a byte ring of records (layout: ``sao_jax.ipc.ring_layout``). Fault model:

* No torn reads: payload, then header, then ``head`` advanced by one aligned
  8-byte store; a producer killed mid-write leaves nothing visible.
* Corruption: magic, per-lane sequence number, length and the XXH3-64
  checksum of the consumer's private copy are checked (no defence against
  an attacker).
* Writes by other processes (``create(authenticate=True)``): a 16-byte MAC of
  payload, lane and sequence number under a key never in shared memory; a
  record failing it, or replaying an older sequence number, is skipped and
  counted (``rejected_records``), so a forgery never shifts genuine records.
* Producer death (pid and start time in ``/proc``, zombies dead): committed
  records are still read; the lane is reported in ``dead_producers()``.
* Backpressure: ``RingFullError`` / ``RingEmptyError`` after ``timeout``;
  waits are counted in ``stats()``.

Memory ordering relies on the store order of x86-64 (TSO); on weakly ordered
CPUs a checksum mismatch is retried briefly before being reported.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

from absl import logging
import numpy as np

from sao_jax.ipc import mac as mac_lib
from sao_jax.ipc import ring_layout as layout
from sao_jax.ipc import segment

# The ring's API types live with the layout they describe.
(HEADER_BYTES, Record, RingError, RingFullError, RingEmptyError, RingDrained,
 RingClosedError, CorruptRecordError) = (
     layout.HEADER_BYTES, layout.Record, layout.RingError,
     layout.RingFullError, layout.RingEmptyError, layout.RingDrained,
     layout.RingClosedError, layout.CorruptRecordError)
_DEFAULT = object()  # "Use the writer's default timeout."

# The layout's names used on every record, bound once: a global lookup costs
# less than a module attribute lookup on this per-record path.
(_HEAD, _TAIL, _RECORDS_READ, _RECORDS_WRITTEN, _BYTES_WRITTEN,
 _HEARTBEAT_NS) = (layout.HEAD, layout.TAIL, layout.RECORDS_READ,
                   layout.RECORDS_WRITTEN, layout.BYTES_WRITTEN,
                   layout.HEARTBEAT_NS)
_HDR, _REC_MAGIC, _WRAP_MAGIC, _ALIGN = (
    layout.HDR, layout.REC_MAGIC, layout.WRAP_MAGIC, layout.ALIGN)
_checksum, _new_record, _byte_view = (
    layout.checksum, layout.new_record, layout.byte_view)
_TAG_BYTES = layout.TAG_BYTES


class RingReader:
  """The single consumer. ``create`` makes (and owns) the segment.

  Usage::

    with RingReader.create(num_lanes=1, lane_bytes=64 << 20) as ring:
      start producers with (ring.name, lane)...
      rec = ring.read(timeout=10.0)   # Record(lane, seq, data)
  """

  def __init__(self, seg: layout.Segment, liveness_interval_s: float = 0.2,
               key: bytes | None = None):
    self._seg = seg
    self._next_lane = 0
    self._liveness_interval = liveness_interval_s
    self._last_liveness = 0.0
    self._dead: dict[int, int] = {}
    self._empty_waits = self._empty_wait_ns = 0
    self._bytes_read = self._checksum_retries = self._rejected = 0
    # Last ``head`` seen per lane: re-read (a cache line the producer keeps
    # writing) only once the records up to it are consumed.
    self._heads = [0] * seg.num_lanes
    self._key = key
    self._mac = mac_lib.Mac(key) if key is not None else None
    self._overhead = HEADER_BYTES + (layout.TAG_BYTES if key else 0)
    self._next_seq = [0] * seg.num_lanes  # Keyed: newest accepted + 1.

  @classmethod
  def create(cls, num_lanes: int, lane_bytes: int, *,
             liveness_interval_s: float = 0.2,
             authenticate: bool = False) -> RingReader:
    """Creates a ring with one lane per producer, each ``lane_bytes`` large.

    Args:
      num_lanes: Number of producers (one process each).
      lane_bytes: Bytes per lane, a multiple of 64; a record needs its payload
        + 32 bytes (+ 16 authenticated), rounded up to 64. Larger records
        are rejected.
      liveness_interval_s: How often producer pids are checked.
      authenticate: Records carry a MAC under a fresh secret ``key``
        (``os.urandom``), which producers must be given.
    """
    seg = layout.Segment.create(num_lanes, lane_bytes, keyed=authenticate)
    logging.info("Created ring %s: %d lanes x %d bytes%s.", seg.name,
                 num_lanes, lane_bytes, ", authenticated" * authenticate)
    key = mac_lib.new_key() if authenticate else None
    return cls(seg, liveness_interval_s, key)

  @property
  def key(self) -> bytes | None:
    """The MAC key to hand to producers (never stored in shared memory)."""
    return self._key

  @property
  def name(self) -> str:
    return self._seg.name

  @property
  def num_lanes(self) -> int:
    return self._seg.num_lanes

  @property
  def lane_bytes(self) -> int:
    return self._seg.lane_bytes

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
    if time.monotonic() - self._last_liveness >= self._liveness_interval:
      self._check_liveness()
    rec = self._try_read()
    if rec is not None:
      return rec
    t0 = time.monotonic_ns()
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = layout.Backoff()
    self._empty_waits += 1
    try:
      while (rec := self._try_read()) is None:
        now = time.monotonic()
        if now - self._last_liveness >= self._liveness_interval:
          self._check_liveness()
          if self._drained():
            raise RingDrained(
                f"Ring {self.name}: all {self.num_lanes} producers closed or "
                f"died (dead lanes: {sorted(self._dead)}); nothing left.")
        if deadline is not None and now >= deadline:
          raise RingEmptyError(
              f"Ring {self.name}: no record for {timeout:.3g} s from any of "
              f"{self.num_lanes} lanes (states {self._lane_states()}); are the "
              "producers running? Increase the timeout for slow samplers.")
        backoff.wait()
      return rec
    finally:
      self._empty_wait_ns += time.monotonic_ns() - t0

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
      magic, _, length, seq, check = _HDR.unpack_from(mv, off)
      if magic == _WRAP_MAGIC:
        ctl[_TAIL] = tail + (cap - off)
        continue
      expected_seq = (ctl[_RECORDS_READ] if mac is None
                      else self._next_seq[lane])
      new_tail = tail + ((self._overhead + length + _ALIGN - 1) & -_ALIGN)
      if (magic != _REC_MAGIC or (seq != expected_seq and mac is None)
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
        tag = mv[end:end + _TAG_BYTES].tobytes()
        if not (seq >= expected_seq and mac.verify(lane, seq, out, tag)
                or self._authentic(out, mv[start:end], lane, seq, tag, tail,
                                   expected_seq)):
          ctl[_TAIL] = new_tail  # Rejected: skipped, counted.
          continue
        self._next_seq[lane] = seq + 1
        ctl[_RECORDS_READ] += 1
      else:
        if _checksum(out) != check and not self._recheck(
            out, mv[start:start + length], check):
          raise CorruptRecordError(
              f"Ring {self.name} lane {lane}: xxh3 mismatch on the committed "
              f"record at counter {tail} ({length} bytes). Shared memory was "
              "corrupted or written outside the ring API.")
        ctl[_RECORDS_READ] = expected_seq + 1
      self._bytes_read += length
      ctl[_TAIL] = new_tail
      return _new_record((lane, seq, out))

  def _recheck(self, out: np.ndarray, src: memoryview, check: int) -> bool:
    ok, retries = layout.recopied(out, src, lambda o: _checksum(o) == check, 5)
    self._checksum_retries += retries
    return ok

  def _authentic(self, out: np.ndarray, src: memoryview, lane: int, seq: int,
                 tag: bytes, tail: int, expected_seq: int) -> bool:
    """Whether a keyed ring's record that failed the first check is genuine
    and newer after re-copies (weak memory ordering); counts rejects."""
    n = out.nbytes
    ok, retries = layout.recopied(out, src, lambda o: self._mac.verify(
        lane, seq, o, tag), 3)
    self._checksum_retries += retries
    if ok and seq >= expected_seq:
      return True
    self._rejected += 1
    logging.warning(
        "Ring %s lane %d: skipped the record at counter %d (seq %d, %d bytes),"
        " %s (%d rejected so far): another process wrote the ring.",
        self.name, lane, tail, seq, n, "a replay" if ok else "bad MAC",
        self._rejected)
    return False

  def _check_liveness(self) -> None:
    self._last_liveness = time.monotonic()
    self._seg.find_dead(self._dead)

  def dead_producers(self) -> dict[int, int]:
    """Lanes whose producer died without closing, as {lane: pid}."""
    self._check_liveness()
    return dict(self._dead)

  def _drained(self) -> bool:
    return all((c[layout.STATE] == layout.CLOSED or lane in self._dead)
               and c[_HEAD] == c[_TAIL]
               for lane, c in enumerate(self._seg.ctl))

  def _lane_states(self) -> list[str]:
    return [l["state"] for l in self.stats()["lanes"]]

  def stats(self) -> dict:
    """Counters: per-lane occupancy and waits, consumer waits, deaths."""
    return {
        **self._seg.stats(self._dead), "bytes_read": self._bytes_read,
        "empty_waits": self._empty_waits,
        "empty_wait_s": self._empty_wait_ns / 1e9,
        "checksum_retries": self._checksum_retries,
        "rejected_records": self._rejected,
    }

  def close(self) -> None:
    """Tells producers to stop; unlinks the segment if this reader made it."""
    if self._seg.shm is None:
      return
    self._seg.glob[layout.G_CLOSED] = 1
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

  def __init__(self, name: str, lane: int, *, timeout: float | None = 60.0,
               key: bytes | None = None):
    """Attaches to ring ``name`` and claims ``lane``, which must be unused.

    Args:
      name: ``RingReader.name`` of the ring.
      lane: Lane index in [0, num_lanes), one per producer process.
      timeout: Default seconds ``write`` waits for space (None: forever).
      key: ``RingReader.key`` of an authenticated ring (None otherwise).
    """
    seg = self._seg = layout.Segment(segment.attach(name), owner=False)
    try:
      ctl = seg.claim_lane(lane, key is not None)
    except BaseException:
      seg.close()
      raise
    self._lane, self._ctl, self._mv = lane, ctl, seg.lanes[lane]
    self._cap = seg.lane_bytes
    self._timeout = timeout
    self._mac = mac_lib.Mac(key) if key is not None else None
    self._overhead = HEADER_BYTES + (layout.TAG_BYTES if key else 0)
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
      parts = (_byte_view(buffers[0]),)
      n = parts[0].nbytes
    else:
      parts = [_byte_view(b) for b in buffers]
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
      check = (_checksum(parts[0]) if len(parts) == 1
               else layout.checksum_parts(parts))
      self._copy_in(start, parts, n)
    else:  # The MAC of the lane's copy (hot in cache), as a trailer.
      check = 0
      self._copy_in(start, parts, n)
      mv = self._mv
      mv[start + n:start + n + layout.TAG_BYTES] = self._mac.tag(
          self._lane, seq, mv[start:start + n])
    _HDR.pack_into(self._mv, off, _REC_MAGIC, 0, n, seq, check)
    ctl[_HEAD] = head + need  # The commit.
    self._seq = seq + 1
    ctl[_RECORDS_WRITTEN] = seq + 1  # Bookkeeping for stats only.
    ctl[_BYTES_WRITTEN] += n
    ctl[_HEARTBEAT_NS] = time.time_ns()
    return seq

  def _copy_in(self, start: int, parts: Sequence[memoryview], n: int) -> None:
    """Copies the payload into the lane (tests replace this to fail mid-way)."""
    del n  # Used by the fault-injecting replacement in tests/test_ring.py.
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
      self._wait_space(head, want, timeout)
    if need <= contiguous:
      return off
    _HDR.pack_into(self._mv, off, _WRAP_MAGIC, 0, 0, 0, 0)
    self._ctl[_HEAD] = head + contiguous
    return -1

  def _wait_space(self, head: int, want: int, timeout: float | None) -> None:
    ctl, cap, glob = self._ctl, self._cap, self._seg.glob
    t0 = time.monotonic_ns()
    deadline = None if timeout is None else time.monotonic() + timeout
    backoff = layout.Backoff()
    try:
      while cap - (head - ctl[_TAIL]) < want:
        if glob[layout.G_CLOSED]:
          raise RingClosedError(
              f"Ring {self._seg.name} was closed by its consumer; stop "
              "producing.")
        if deadline is not None and time.monotonic() >= deadline:
          raise RingFullError(
              f"Lane {self._lane} of ring {self._seg.name} stayed full for "
              f"{timeout:.3g} s ({head - ctl[_TAIL]}/{cap} bytes used, "
              f"need {want}); the consumer is not reading. Check the trainer "
              "or raise lane_bytes/timeout.")
        ctl[_HEARTBEAT_NS] = time.time_ns()
        backoff.wait()
      self._tail = ctl[_TAIL]
    finally:
      ctl[layout.FULL_WAITS] += 1
      ctl[layout.FULL_WAIT_NS] += time.monotonic_ns() - t0

  def close(self) -> None:
    """Marks the lane closed (no more records) and detaches."""
    if self._seg.shm is None:
      return
    self._ctl[layout.STATE] = layout.CLOSED
    self._ctl = self._mv = None
    self._seg.close()

  def __enter__(self) -> RingWriter:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
