"""Hypothesis state machine: the ring against a pure-Python model of its lanes.

The model is the ring's documented layout: per lane a deque of records
(``align64(32 + n)`` bytes each) and wrap markers (the rest of the lane when a
record would not fit before its end), monotonic head/tail counters, and a
round-robin consumer. An authenticated ring's records also carry a 16-byte
MAC trailer (``KeyedRingMachine``).
"""

import collections

import hypothesis
from hypothesis import stateful
from hypothesis import strategies as st
import numpy as np
import pytest

from sao_jax.ipc import ring

_LANES = 2
_CAP = 512


def _align(n: int) -> int:
  return (n + 63) // 64 * 64


def _payload(i: int, size: int) -> bytes:
  return ((np.arange(size) * 31 + i) % 256).astype(np.uint8).tobytes()


class _LaneModel:

  def __init__(self, overhead: int = ring.HEADER_BYTES):
    self.overhead = overhead
    self.head = self.tail = 0
    self.items = collections.deque()  # ("rec", need, bytes) | ("wrap", n, None)
    self.written = self.read = self.full_waits = 0

  def free(self) -> int:
    return _CAP - (self.head - self.tail)

  def write(self, payload: bytes) -> str:
    need = _align(self.overhead + len(payload))
    if need > _CAP:
      return "oversize"
    contiguous = _CAP - self.head % _CAP
    if need > contiguous:
      if self.free() < contiguous:
        self.full_waits += 1
        return "full"
      self.items.append(("wrap", contiguous, None))
      self.head += contiguous
    if self.free() < need:
      self.full_waits += 1
      return "full"
    self.items.append(("rec", need, payload))
    self.head += need
    self.written += 1
    return "ok"

  def pop(self) -> bytes | None:
    while self.items:
      kind, n, payload = self.items.popleft()
      self.tail += n
      if kind == "rec":
        self.read += 1
        return payload
    return None


class RingMachine(stateful.RuleBasedStateMachine):

  AUTHENTICATE = False

  def __init__(self):
    super().__init__()
    self.reader = ring.RingReader.create(num_lanes=_LANES, lane_bytes=_CAP,
                                         authenticate=self.AUTHENTICATE)
    self.writers = [ring.RingWriter(self.reader.name, lane, timeout=0.0,
                                    key=self.reader.key)
                    for lane in range(_LANES)]
    overhead = ring.HEADER_BYTES + 16 * self.AUTHENTICATE
    self.model = [_LaneModel(overhead) for _ in range(_LANES)]
    self.next_lane = 0
    self.count = 0

  @stateful.rule(lane=st.integers(0, _LANES - 1),
                 size=st.one_of(st.integers(0, 200),
                                st.integers(0, _CAP + 64)))
  def write(self, lane, size):
    self.count += 1
    payload = _payload(self.count, size)
    wraps = sum(k == "wrap" for k, _, _ in self.model[lane].items)
    expected = self.model[lane].write(payload)
    hypothesis.event(expected)
    if sum(k == "wrap" for k, _, _ in self.model[lane].items) > wraps:
      hypothesis.event("wrapped")
    if expected == "oversize":
      with pytest.raises(ValueError, match="does not fit in a lane"):
        self.writers[lane].write(payload)
    elif expected == "full":
      with pytest.raises(ring.RingFullError):
        self.writers[lane].write(payload)
    else:
      seq = self.writers[lane].write(payload)
      assert seq == self.model[lane].written - 1

  @stateful.rule()
  def read(self):
    for k in range(_LANES):
      lane = (self.next_lane + k) % _LANES
      payload = self.model[lane].pop()
      if payload is not None:
        self.next_lane = (lane + 1) % _LANES
        rec = self.reader.read(timeout=0.0)
        assert rec.lane == lane
        assert rec.seq == self.model[lane].read - 1
        assert rec.data.tobytes() == payload
        return
    hypothesis.event("empty")
    with pytest.raises(ring.RingEmptyError):
      self.reader.read(timeout=0.0)

  @stateful.invariant()
  def counters_match_model(self):
    for lane, stats in enumerate(self.reader.stats()["lanes"]):
      m = self.model[lane]
      assert stats["occupancy_bytes"] == m.head - m.tail
      assert stats["records_written"] == m.written
      assert stats["records_read"] == m.read
      assert stats["full_waits"] == m.full_waits
    assert self.reader.stats()["rejected_records"] == 0

  def teardown(self):
    for w in self.writers:
      w.close()
    self.reader.close()


RingMachine.TestCase.settings = hypothesis.settings(
    max_examples=60, stateful_step_count=60, deadline=None,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
test_ring_state_machine = RingMachine.TestCase


class KeyedRingMachine(RingMachine):
  AUTHENTICATE = True


KeyedRingMachine.TestCase.settings = RingMachine.TestCase.settings
test_keyed_ring_state_machine = KeyedRingMachine.TestCase
