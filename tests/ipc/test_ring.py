"""The shared-memory trajectory ring and codec within one process.

Across processes: tests/ipc/test_ring_processes.py.
"""

import os
import stat
import time

import numpy as np
import pytest
import xxhash

from sao_jax.data import trajectory as codec
from sao_jax.ipc import ring
from sao_jax.ipc import ring_segment
from sao_jax.ipc import segment
from sao_jax.data.trajectory import FinishReason
from sao_jax.data.trajectory import Trajectory

def _exists(name: str) -> bool:
  return os.path.exists(segment.shm_path(name))


def _lane_array(r: ring.RingReader, lane: int = 0) -> np.ndarray:
  """A writable uint8 view of a lane's bytes (to corrupt records on purpose)."""
  return np.frombuffer(r._seg.lanes[lane], np.uint8)


# --- in-process behaviour ---------------------------------------------------


def test_raw_records_round_trip_in_order_across_wraps():
  rng = np.random.default_rng(0)
  sent, got, fulls = [], [], 0
  with ring.RingReader.create(num_lanes=1, lane_bytes=4096) as r:
    with ring.RingWriter(r.name, lane=0, timeout=0.0) as w:
      for i in range(300):  # 0..1.5 KiB each: wraps the 4 KiB lane often.
        payload = rng.integers(0, 256, int(rng.integers(0, 1500)), np.uint8)
        while True:
          try:
            assert w.write(payload) == i
            break
          except ring.RingFullError:  # Full: the consumer makes room.
            fulls += 1
            got.append(r.read(timeout=0.0))
        sent.append(payload.tobytes())
      while len(got) < len(sent):
        got.append(r.read(timeout=0.0))
      stats = r.stats()
  assert [x.seq for x in got] == list(range(300))
  assert [x.data.tobytes() for x in got] == sent
  assert fulls > 50  # The lane really was full (and wrapped) many times.
  assert stats["records_read"] == 300
  assert stats["lanes"][0]["full_waits"] == fulls
  assert stats["lanes"][0]["bytes_written"] == sum(map(len, sent))


def test_gathered_buffers_form_one_record():
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 12) as r:
    with ring.RingWriter(r.name, lane=0) as w:
      a = np.arange(10, dtype=np.int32)
      b = np.linspace(0, 1, 7, dtype=np.float64)[::2]  # Non-contiguous view.
      w.write(b"hdr", a, b, memoryview(b"tail"))
      rec = r.read(timeout=1.0)
  expected = b"hdr" + a.tobytes() + np.ascontiguousarray(b).tobytes() + b"tail"
  assert rec.data.tobytes() == expected
  assert (rec.lane, rec.seq) == (0, 0)


def test_trajectory_codec_round_trips_through_ring():
  rng = np.random.default_rng(1)
  n = 37
  traj = Trajectory(
      prompt_id=2**40 + 3, tokens=rng.integers(0, 50000, n),
      action_mask=rng.integers(0, 2, n), rollout_logp=rng.normal(size=n),
      policy_version=rng.integers(-1, 9, n), rewards=rng.normal(size=n),
      task="gsm8k/ü", finish_reason=FinishReason.ERROR, group_id=5,
      error="tool raised ValueError",
  )
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 12) as r:
    with ring.RingWriter(r.name, lane=0) as w:
      w.write(*codec.encode(traj))
      data = r.read(timeout=1.0).data
  # 36-byte header padded to 40, 17 bytes per token, then task and error.
  assert data.nbytes == 40 + 17 * n + len(traj.task.encode()) + len(traj.error)
  assert data.tobytes() == b"".join(
      bytes(memoryview(b).cast("B")) for b in codec.encode(traj))
  back = codec.decode(data)
  for f in ("tokens", "action_mask", "rollout_logp", "policy_version",
            "rewards"):
    np.testing.assert_array_equal(getattr(back, f), getattr(traj, f))
    assert getattr(back, f).dtype == getattr(traj, f).dtype
  assert np.shares_memory(back.tokens, data)  # Views, not copies.
  assert (back.prompt_id, back.task, back.finish_reason, back.group_id,
          back.error) == (traj.prompt_id, traj.task, FinishReason.ERROR, 5,
                          traj.error)
  with pytest.raises(ValueError, match="truncated or corrupted"):
    codec.decode(data[:-1])
  with pytest.raises(ValueError, match="Not a trajectory record"):
    codec.decode(b"x" * 64)


def test_oversize_full_empty_and_drained():
  with ring.RingReader.create(num_lanes=2, lane_bytes=1024) as r:
    w = ring.RingWriter(r.name, lane=1, timeout=0.05)
    with pytest.raises(ValueError, match="does not fit in a lane of 1024"):
      w.write(b"x" * (1024 - ring.HEADER_BYTES + 1))
    w.write(b"y" * (1024 - ring.HEADER_BYTES))  # Exactly a full lane.
    with pytest.raises(ring.RingFullError, match="stayed full"):
      w.write(b"z")
    assert r.stats()["lanes"][1]["occupancy"] == 1.0
    assert r.stats()["lanes"][1]["full_waits"] == 1
    assert r.stats()["lanes"][1]["full_wait_s"] >= 0.05
    assert 0 <= r.stats()["lanes"][1]["heartbeat_age_s"] < 5.0
    assert r.stats()["lanes"][0]["heartbeat_age_s"] is None  # No producer.
    assert r.read(timeout=0.1).data.tobytes() == b"y" * 992
    with pytest.raises(ring.RingEmptyError, match="no record for"):
      r.read(timeout=0.05)
    assert r.stats()["empty_waits"] == 1
    w.close()
    with pytest.raises(ring.RingEmptyError):  # Lane 0 never closed.
      r.read(timeout=0.3)
    w0 = ring.RingWriter(r.name, lane=0)
    w0.write(b"last")
    w0.close()
    assert r.read(timeout=1.0).data.tobytes() == b"last"
    with pytest.raises(ring.RingDrained):
      r.read(timeout=1.0)


def test_checksum_catches_a_corrupted_committed_record():
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 15) as r:
    with ring.RingWriter(r.name, lane=0) as w:
      for size in (0, 1, 7, 1001, 8192, 8193, 8199, 8200):  # Word-sum tails.
        payload = np.arange(size, dtype=np.uint8) * 3
        w.write(payload)
        np.testing.assert_array_equal(r.read(timeout=1.0).data, payload)
      w.write(b"a" * 10_000)
      w.write(b"b" * 10_000)
      data = _lane_array(r)
      start = (int(r._seg.ctl[0][ring_segment.TAIL]) % r.lane_bytes
               + ring.HEADER_BYTES)
      data[start + 5000] ^= 0x10  # One bit flipped in the committed record.
      with pytest.raises(ring.CorruptRecordError, match="xxh3 mismatch"):
        r.read(timeout=1.0)
      assert r.stats()["checksum_retries"] == 5
      del data


def test_gathered_record_checksum_is_that_of_the_concatenation():
  expected = xxhash.xxh3_64_intdigest
  payload = np.random.default_rng(7).integers(0, 256, 70_001, np.uint8)
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 18) as r:
    with ring.RingWriter(r.name, lane=0) as w:
      for parts in ([payload], [payload[:7], payload[7:]],
                    [payload[:1000], b"", payload[1000:5000].tobytes(),
                     payload[5000:].view(np.uint8)]):
        off = int(r._seg.ctl[0][ring_segment.HEAD]) % r.lane_bytes
        w.write(*parts)
        header = ring.HDR.unpack_from(r._seg.lanes[0], off)
        assert header[4] == expected(payload.tobytes())
        np.testing.assert_array_equal(r.read(timeout=1.0).data, payload)


@pytest.mark.parametrize("size,flip", [
    (10_003, 10_002),  # Last byte.
    (10_000, 0),  # First byte.
    (1 << 16, (1 << 16) - 1),
    (1 << 16, -1),  # Two 8-byte words swapped: the byte multiset is kept.
])
def test_xxh3_catches_a_change_in_gathered_record(size, flip):
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 18) as r:
    with ring.RingWriter(r.name, lane=0) as w:
      payload = np.random.default_rng(size).integers(0, 256, size, np.uint8)
      w.write(payload[:7], payload[7:], timeout=1.0)  # Gathered: 2 buffers.
      data = _lane_array(r)
      start = (int(r._seg.ctl[0][ring_segment.TAIL]) % r.lane_bytes
               + ring.HEADER_BYTES)
      np.testing.assert_array_equal(data[start:start + size], payload)
      if flip >= 0:
        data[start + flip] ^= 0x01
      else:
        words = data[start:start + 64].view(np.uint64)
        words[[0, 5]] = words[[5, 0]]
        assert not np.array_equal(data[start:start + size], payload)
        del words
      with pytest.raises(ring.CorruptRecordError, match="xxh3 mismatch"):
        r.read(timeout=1.0)
      del data


def test_backoff_yields_before_it_sleeps(monkeypatch):
  calls = []
  monkeypatch.setattr(ring_segment, "sched_yield",
                      lambda: calls.append("yield"))
  monkeypatch.setattr(ring_segment.time, "sleep", calls.append)
  backoff = ring_segment.Backoff(max_sleep=1e-3)
  spins = ring_segment.Backoff._SPINS
  for _ in range(spins + 12):
    backoff.wait()
  assert calls[:spins] == ["yield"] * spins
  sleeps = calls[spins:]
  # Never time.sleep(0): on CPython 3.11/Linux it sleeps the timer slack.
  assert all(0 < s <= 1e-3 for s in sleeps)
  assert sleeps == sorted(sleeps) and sleeps[-1] == 1e-3


def test_headers_are_validated_before_the_checksum():
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 12) as r:
    with ring.RingWriter(r.name, lane=0) as w:
      w.write(b"x" * 10)
      assert r.read(timeout=1.0).data.tobytes() == b"x" * 10
      w.write(b"y" * 10)
      off = int(r._seg.ctl[0][ring_segment.TAIL]) % r.lane_bytes
      _lane_array(r)[off + 16] = 99  # Sequence number field.
      with pytest.raises(ring.CorruptRecordError, match="seq 99 expected 1"):
        r.read(timeout=1.0)


def test_lane_claims_are_exclusive_and_checked():
  with ring.RingReader.create(num_lanes=1, lane_bytes=1024) as r:
    with pytest.raises(ValueError, match="out of range"):
      ring.RingWriter(r.name, lane=1)
    w = ring.RingWriter(r.name, lane=0)
    # A second producer may not take a lane whose producer is alive.
    with pytest.raises(ring.RingError, match="held by live producer"):
      ring.RingWriter(r.name, lane=0)
    w.close()
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ring.RingWriter(r.name, lane=0)


def test_a_used_lane_is_not_reused():
  with ring.RingReader.create(num_lanes=1, lane_bytes=1024) as r:
    a = ring.RingWriter(r.name, lane=0)
    a.write(b"from a")
    a.close()
    with pytest.raises(ring.RingError, match="lanes are not reused"):
      ring.RingWriter(r.name, lane=0)
    assert r.read(timeout=1.0).data.tobytes() == b"from a"
    with pytest.raises(ring.RingDrained):
      r.read(timeout=1.0)


def test_closed_consumer_stops_blocked_producer():
  r = ring.RingReader.create(num_lanes=1, lane_bytes=256)
  w = ring.RingWriter(r.name, lane=0, timeout=5.0)
  w.write(b"a" * 200)
  r._seg.glob[ring_segment.G_CLOSED] = 1  # What close() signals, then unmaps.
  t0 = time.monotonic()
  with pytest.raises(ring.RingClosedError, match="closed by its consumer"):
    w.write(b"b" * 200)
  assert time.monotonic() - t0 < 1.0
  w.close()
  r.close()


# --- segment hygiene --------------------------------------------------------


def test_segment_is_private_and_unlinked_on_close():
  r = ring.RingReader.create(num_lanes=1, lane_bytes=1024)
  assert r.name.startswith("sao_ring_")  # conftest's leak check looks for it.
  mode = os.stat(segment.shm_path(r.name)).st_mode
  assert stat.S_IMODE(mode) == 0o600
  name = r.name
  r.close()
  assert not _exists(name)


def test_segment_unlinked_when_with_block_raises():
  with pytest.raises(KeyError):
    with ring.RingReader.create(num_lanes=1, lane_bytes=1024) as r:
      name = r.name
      assert _exists(name)
      raise KeyError("boom")
  assert not _exists(name)


def test_write_takes_any_bytes_like_and_array_layout():
  base = np.arange(24, dtype=np.float32).reshape(4, 6)
  cases = [
      base,  # 2-D, native float32: cast to bytes without a copy.
      base[:, ::2],  # Non-contiguous: copied once.
      base.astype(">f4"),  # Big-endian: no memoryview cast, copied once.
      np.array([True, False, True]),
      bytearray(b"abc"),
      memoryview(b"xyz"),
  ]
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 12) as r:
    with ring.RingWriter(r.name, lane=0) as w:
      for c in cases:
        w.write(c)
        expected = (np.ascontiguousarray(c).tobytes()
                    if isinstance(c, np.ndarray) else bytes(c))
        assert r.read(timeout=1.0).data.tobytes() == expected


def test_close_while_a_caller_holds_lane_arrays():
  r = ring.RingReader.create(num_lanes=1, lane_bytes=1 << 12)
  name = r.name
  with ring.RingWriter(name, lane=0) as w:
    w.write(b"held")
    rec = r.read(timeout=1.0)
  lane_array = _lane_array(r)
  r.close()  # Must neither raise nor leave the segment linked.
  assert bytes(rec.data) == b"held"
  start = ring.HEADER_BYTES
  assert lane_array[start:start + 4].tobytes() == b"held"
  assert not os.path.exists(f"/dev/shm/{name}")


def test_segment_accounting_ignores_other_programs_sao_files():
  """Only names ``segment.make_name`` writes are ours: the report's
  ``sao_probe_root_0600`` and the session's foreign files are not, whatever
  their fields; conftest's copy of the pattern agrees with the library's."""
  import conftest  # pylint: disable=g-import-not-at-top
  ours = segment.make_name("ring")
  assert segment.creator_pid(ours) == os.getpid()
  assert segment.creator_pid(f"/dev/shm/{ours}") == os.getpid()
  assert conftest._creator_pid(ours) == os.getpid()  # pylint: disable=protected-access
  foreign = (*conftest.FOREIGN_NAMES, "sao_w_123", "sao_ring_1_ABCDEF12",
             "sao_ring_1_deadbeef0", "xsao_ring_1_deadbeef")
  for name in foreign:
    assert segment.creator_pid(name) is None, name
    assert conftest._creator_pid(name) == -1, name  # pylint: disable=protected-access
  # The session fixture put the foreign files there (or another session
  # did): the suite's segment checks below and after run beside them.
  present = set(os.listdir("/dev/shm"))
  assert set(conftest.FOREIGN_NAMES) <= present
  r = ring.RingReader.create(num_lanes=1, lane_bytes=1 << 12)
  try:
    assert segment.creator_pid(r.name) == os.getpid()
    assert r.name in conftest._our_segments()  # pylint: disable=protected-access
  finally:
    r.close()
  assert not set(conftest.FOREIGN_NAMES) & conftest._our_segments()  # pylint: disable=protected-access
