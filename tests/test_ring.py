"""Tests of the shared-memory trajectory ring (sao_jax/ipc ring and codec)."""

import multiprocessing as mp
import os
import signal
import stat
import struct
import time

import numpy as np
import pytest
import xxhash

from sao_jax.ipc import codec
from sao_jax.ipc import ring
from sao_jax.ipc import ring_layout
from sao_jax.ipc import segment
from sao_jax.trajectory import FinishReason
from sao_jax.trajectory import Trajectory

_SPAWN = mp.get_context("spawn")


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
      start = (int(r._seg.ctl[0][ring_layout.TAIL]) % r.lane_bytes
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
        off = int(r._seg.ctl[0][ring_layout.HEAD]) % r.lane_bytes
        w.write(*parts)
        header = ring_layout.HDR.unpack_from(r._seg.lanes[0], off)
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
      start = (int(r._seg.ctl[0][ring_layout.TAIL]) % r.lane_bytes
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
  monkeypatch.setattr(ring_layout, "sched_yield",
                      lambda: calls.append("yield"))
  monkeypatch.setattr(ring_layout.time, "sleep", calls.append)
  backoff = ring_layout.Backoff(max_sleep=1e-3)
  spins = ring_layout.Backoff._SPINS
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
      off = int(r._seg.ctl[0][ring_layout.TAIL]) % r.lane_bytes
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
  r._seg.glob[ring_layout.G_CLOSED] = 1  # What close() signals before unmapping.
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


def _create_and_wait(q, install_handler: bool):
  if install_handler:
    signal.signal(signal.SIGTERM, lambda *_: os._exit(7))
  r = ring.RingReader.create(num_lanes=1, lane_bytes=1024)
  q.put(r.name)
  # Short sleeps: SIGTERM may be delivered to the queue's feeder thread, and
  # Python runs handlers in the main thread only once it wakes up.
  for _ in range(600):
    time.sleep(0.1)


@pytest.mark.multiprocess
@pytest.mark.parametrize("install_handler,exitcode",
                         [(False, -signal.SIGTERM), (True, 7)])
def test_segment_unlinked_when_creator_gets_sigterm(install_handler, exitcode):
  q = _SPAWN.Queue()
  p = _SPAWN.Process(target=_create_and_wait, args=(q, install_handler))
  p.start()
  name = None
  try:
    name = q.get(timeout=60)
    assert _exists(name)
    os.kill(p.pid, signal.SIGTERM)
    p.join(timeout=30)
    # The previous handler still runs: default death, or the user's exit(7).
    assert p.exitcode == exitcode
    assert not _exists(name)
  finally:
    if p.is_alive():
      p.kill()
      p.join()
    if name and _exists(name):  # Failed: clean up so only this test fails.
      os.unlink(segment.shm_path(name))


def _attach_and_exit(name, q):
  w = ring.RingWriter(name, lane=0)
  w.write(b"from child")
  q.put(os.getpid())  # Exits without close(): the lane stays 'active'.


@pytest.mark.multiprocess
def test_attaching_process_exit_does_not_unlink():
  with ring.RingReader.create(num_lanes=1, lane_bytes=1024) as r:
    q = _SPAWN.Queue()
    p = _SPAWN.Process(target=_attach_and_exit, args=(r.name, q))
    p.start()
    pid = q.get(timeout=60)
    p.join(timeout=30)
    assert p.exitcode == 0
    assert _exists(r.name)
    assert r.read(timeout=1.0).data.tobytes() == b"from child"
    assert r.dead_producers() == {0: pid}  # Exited without closing its lane.
    with pytest.raises(ring.RingDrained):
      r.read(timeout=1.0)


# --- many records, several processes ----------------------------------------

_N_RECORDS = 20_000
_POOL_BYTES = 2 << 20
_REC_HDR = struct.Struct("<IIQ")  # producer, seq, size.


def _pool() -> np.ndarray:
  return np.random.default_rng(1234).integers(0, 256, _POOL_BYTES, np.uint8)


def _sizes(producer: int, n: int) -> np.ndarray:
  """100 B .. 1 MiB, skewed small (median ~180 B, 1% above ~700 KiB)."""
  u = np.random.default_rng(producer).random(n)
  return (100 * (10485.76 ** (u**4))).astype(np.int64)


def _offset(producer: int, seq: int) -> int:
  return (producer * 7919 + seq * 104729) % (1 << 20)


def _produce(name, lane, n):
  pool, sizes = _pool(), _sizes(lane, n)
  with ring.RingWriter(name, lane, timeout=120.0) as w:
    for seq in range(n):
      size = int(sizes[seq])
      off = _offset(lane, seq)
      w.write(_REC_HDR.pack(lane, seq, size), pool[off:off + size - 16])


@pytest.mark.multiprocess
def test_two_producers_every_record_once_intact_in_order():
  pool = _pool()
  sizes = [_sizes(p, _N_RECORDS) for p in range(2)]
  next_seq = [0, 0]
  total = 0
  with ring.RingReader.create(num_lanes=2, lane_bytes=4 << 20) as r:
    procs = [_SPAWN.Process(target=_produce, args=(r.name, lane, _N_RECORDS))
             for lane in range(2)]
    for p in procs:
      p.start()
    try:
      while True:
        try:
          rec = r.read(timeout=120.0)
        except ring.RingDrained:
          break
        producer, seq, size = _REC_HDR.unpack_from(rec.data)
        assert producer == rec.lane and seq == rec.seq
        assert seq == next_seq[producer], "lost, duplicated or reordered"
        assert size == rec.data.nbytes == sizes[producer][seq]
        off = _offset(producer, seq)
        assert np.array_equal(rec.data[16:], pool[off:off + size - 16])
        next_seq[producer] += 1
        total += size
      stats = r.stats()
    finally:
      for p in procs:
        p.join(timeout=60)
  assert [p.exitcode for p in procs] == [0, 0]
  assert next_seq == [_N_RECORDS, _N_RECORDS]
  assert total == sum(int(s.sum()) for s in sizes)
  assert stats["records_read"] == 2 * _N_RECORDS
  assert stats["dead_producers"] == []
  assert all(l["occupancy_bytes"] == 0 for l in stats["lanes"])


# --- producer killed mid-write -----------------------------------------------

_BIG = 6 << 20


def _produce_then_hang(name, lane, n_small, paused):
  copy_in = ring.RingWriter._copy_in

  def copy_half_then_hang(self, start, parts, n):
    """The fault: the big record stops half-copied, before its commit."""
    if n != _BIG:
      return copy_in(self, start, parts, n)
    (part,) = parts
    copy_in(self, start, [part[:n // 2]], n // 2)
    paused.set()
    time.sleep(120)

  ring.RingWriter._copy_in = copy_half_then_hang  # In this child only.
  with ring.RingWriter(name, lane) as w:
    for seq in range(n_small):
      w.write(np.full(1000 + seq, seq % 251, np.uint8))
    w.write(np.full(_BIG, 7, np.uint8))  # Pauses half-copied; then killed.


def _produce_steady(name, lane, n, go):
  go.wait(60)
  with ring.RingWriter(name, lane) as w:
    for seq in range(n):
      w.write(np.full(500 + seq % 5000, seq % 253, np.uint8))


@pytest.mark.multiprocess
def test_producer_killed_mid_write_is_reported_and_never_torn():
  n_small, n_steady = 50, 400
  paused, go = _SPAWN.Event(), _SPAWN.Event()
  with ring.RingReader.create(num_lanes=2, lane_bytes=16 << 20,
                              liveness_interval_s=0.05) as r:
    victim = _SPAWN.Process(target=_produce_then_hang,
                            args=(r.name, 0, n_small, paused))
    steady = _SPAWN.Process(target=_produce_steady,
                            args=(r.name, 1, n_steady, go))
    victim.start()
    steady.start()
    try:
      assert paused.wait(60), "victim never reached the mid-write pause"
      victim.kill()  # SIGKILL while the 6 MiB record is half written.
      time.sleep(0.2)  # Not joined: the victim stays a zombie meanwhile.
      go.set()
      got = {0: [], 1: []}
      for rec in r:  # Ends when lane 0 is dead and lane 1 closed, drained.
        got[rec.lane].append(rec)
      dead = r.dead_producers()
      stats = r.stats()
    finally:
      for p in (victim, steady):
        p.join(timeout=60)
  assert victim.exitcode == -signal.SIGKILL and steady.exitcode == 0
  assert dead == {0: victim.pid}
  assert stats["producer_deaths"] == 1 and stats["dead_producers"] == [0]
  assert [x.seq for x in got[0]] == list(range(n_small))  # No partial 51st.
  for x in got[0]:
    np.testing.assert_array_equal(
        x.data, np.full(1000 + x.seq, x.seq % 251, np.uint8))
  assert [x.seq for x in got[1]] == list(range(n_steady))
  for x in got[1]:
    np.testing.assert_array_equal(
        x.data, np.full(500 + x.seq % 5000, x.seq % 253, np.uint8))
  # The half-written bytes sit past the committed head, never delivered.
  assert stats["lanes"][0]["records_written"] == n_small
  assert stats["lanes"][0]["occupancy_bytes"] == 0


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
  assert lane_array[ring.HEADER_BYTES:ring.HEADER_BYTES + 4].tobytes() == b"held"
  assert not os.path.exists(f"/dev/shm/{name}")
