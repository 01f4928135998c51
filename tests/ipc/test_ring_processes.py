"""The trajectory ring across processes: exactly once and in order, no torn
read after a producer's SIGKILL, segment cleanup on SIGTERM and exit."""

import multiprocessing as mp
import os
import signal
import struct
import time

import numpy as np
import pytest

from sao_jax.ipc import ring
from sao_jax.ipc import segment

_SPAWN = mp.get_context("spawn")


def _exists(name: str) -> bool:
  return os.path.exists(segment.shm_path(name))


# --- segment cleanup ----------------------------------------------------------


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


def _produce(name, lane, n, key=None):
  pool, sizes = _pool(), _sizes(lane, n)
  with ring.RingWriter(name, lane, timeout=120.0, key=key) as w:
    for seq in range(n):
      size = int(sizes[seq])
      off = _offset(lane, seq)
      w.write(_REC_HDR.pack(lane, seq, size), pool[off:off + size - 16])


@pytest.mark.multiprocess
@pytest.mark.parametrize("authenticate", [False, True])
def test_two_producers_every_record_once_intact_in_order(authenticate):
  pool = _pool()
  sizes = [_sizes(p, _N_RECORDS) for p in range(2)]
  next_seq = [0, 0]
  total = 0
  with ring.RingReader.create(num_lanes=2, lane_bytes=4 << 20,
                              authenticate=authenticate) as r:
    procs = [_SPAWN.Process(target=_produce,
                            args=(r.name, lane, _N_RECORDS, r.key))
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
  assert stats["rejected_records"] == 0
  assert all(l["occupancy_bytes"] == 0 for l in stats["lanes"])


# --- producer killed mid-write -----------------------------------------------

_BIG = 6 << 20


def _produce_then_hang(name, lane, n_small, paused, key=None):
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
  with ring.RingWriter(name, lane, key=key) as w:
    for seq in range(n_small):
      w.write(np.full(1000 + seq, seq % 251, np.uint8))
    w.write(np.full(_BIG, 7, np.uint8))  # Pauses half-copied; then killed.


def _produce_steady(name, lane, n, go, key=None):
  go.wait(60)
  with ring.RingWriter(name, lane, key=key) as w:
    for seq in range(n):
      w.write(np.full(500 + seq % 5000, seq % 253, np.uint8))


@pytest.mark.multiprocess
@pytest.mark.parametrize("authenticate", [False, True])
def test_producer_killed_mid_write_is_reported_and_never_torn(authenticate):
  n_small, n_steady = 50, 400
  paused, go = _SPAWN.Event(), _SPAWN.Event()
  with ring.RingReader.create(num_lanes=2, lane_bytes=16 << 20,
                              liveness_interval_s=0.05,
                              authenticate=authenticate) as r:
    victim = _SPAWN.Process(target=_produce_then_hang,
                            args=(r.name, 0, n_small, paused, r.key))
    steady = _SPAWN.Process(target=_produce_steady,
                            args=(r.name, 1, n_steady, go, r.key))
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
  assert stats["rejected_records"] == 0
