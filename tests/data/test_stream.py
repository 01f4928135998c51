"""Tests of the grain pipelines: ring -> [B, T] batches, and the prompt side."""

import multiprocessing as mp

import jax
import numpy as np
import pytest

from sao_jax.data import consumed
from sao_jax.data import prompts
from sao_jax.data import stream
from sao_jax.data import trajectory
from sao_jax.ipc import ring
from sao_jax.data.trajectory import NO_VERSION
from sao_jax.data.trajectory import StalenessPolicy
from sao_jax.data.trajectory import Trajectory

_SPAWN = mp.get_context("spawn")


def _traj(i: int, length: int, oldest: int, newest: int | None = None):
  """Prompt of 2 tokens, then actions; versions oldest..newest; reward 1+i."""
  newest = oldest if newest is None else newest
  mask = np.ones(length, np.uint8)
  mask[:2] = 0
  versions = np.full(length, NO_VERSION)
  versions[2:] = np.linspace(oldest, newest, length - 2).round()
  rewards = np.zeros(length, np.float32)
  rewards[-1] = 1.0 + i
  rewards[length // 2] = 0.5  # A mid-episode reward too.
  return Trajectory(
      prompt_id=100 + i, tokens=np.arange(length) + 10 * i, action_mask=mask,
      rollout_logp=-np.arange(length) / 10.0, policy_version=versions,
      rewards=rewards, task="t",
  )


def _fill(name, trajs):
  with ring.RingWriter(name, lane=0) as w:
    for t in trajs:
      w.write(*trajectory.encode(t))


def test_batches_padding_staleness_filter_and_counters():
  # (length, oldest version): trainer is at version 10, max_staleness 3.
  spec = [(5, 9), (8, 6), (7, 7), (12, 8), (3, 10), (6, 8, ), (4, 2), (8, 9)]
  trajs = [_traj(i, n, v) for i, (n, v) in enumerate(spec)]
  trajs.append(_traj(8, 6, 7, 9))  # Multi-version, staleness 3: admitted.
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 16) as r:
    _fill(r.name, trajs)
    s = stream.TrajectoryStream(
        r, batch_size=3, seq_len=8, trainer_version=lambda: 10,
        staleness=StalenessPolicy(3), read_timeout=5.0)
    batches = list(s.dataset)
  # Staleness: 1,4,3,2,0,2,8,1,3 -> drop #1 and #6; overlong #3 (12 > 8).
  admitted = [0, 2, 4, 5, 7, 8]
  assert len(batches) == 2
  c = s.counters.as_dict()
  assert (c["records_read"], c["dropped_stale"], c["dropped_overlong"],
          c["admitted"], c["truncated"]) == (9, 2, 1, 7, 0)
  assert c["multi_version"] == 1
  assert c["staleness_max"] == 3
  assert c["staleness_sum"] == 1 + 3 + 2 + 0 + 2 + 1 + 3
  b = np.concatenate([x["prompt_id"] for x in batches])
  np.testing.assert_array_equal(b, [100 + i for i in admitted])
  for batch in batches:
    assert batch["tokens"].shape == (3, 8) and batch["tokens"].dtype == np.int32
    assert batch["attention_mask"].dtype == bool
  rows = {int(p): (bi, ri) for bi, x in enumerate(batches)
          for ri, p in enumerate(x["prompt_id"])}
  for i in admitted:
    t, (bi, ri) = trajs[i], rows[100 + i]
    x = {k: v[ri] for k, v in batches[bi].items()}
    n = t.length
    np.testing.assert_array_equal(x["tokens"][:n], t.tokens)
    np.testing.assert_array_equal(x["tokens"][n:], 0)
    np.testing.assert_array_equal(x["action_mask"][:n], t.action_mask)
    np.testing.assert_array_equal(x["action_mask"][n:], 0)
    np.testing.assert_array_equal(x["policy_version"][n:], NO_VERSION)
    np.testing.assert_array_equal(x["rollout_logp"][:n], t.rollout_logp)
    np.testing.assert_array_equal(x["rewards"][:n], t.rewards)
    assert x["attention_mask"].sum() == n == x["length"]
    assert x["staleness"] == t.staleness(10)


def test_every_record_read_is_a_consumed_episode_batch_by_batch():
  # Episodes reach the ring out of order; two are dropped stale (consumed
  # all the same); a batch reads only up to its last row.
  trajs = [_traj(i, 5, 2 if i % 3 == 0 else 9) for i in range(6)]
  for t, episode in zip(trajs, (1, 0, 3, 5, 2, 4)):
    t.group_id = episode
  seen = consumed.ConsumedEpisodes()
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 16) as r:
    _fill(r.name, trajs)
    s = stream.TrajectoryStream(
        r, batch_size=2, seq_len=6, trainer_version=lambda: 10,
        staleness=StalenessPolicy(3), read_timeout=5.0, consumed=seen)
    batches = iter(s.dataset)
    next(batches)
    assert (seen.watermark, seen.above) == (2, {3})
    next(batches)
  assert (seen.watermark, seen.above, seen.duplicates) == (6, set(), 0)
  assert s.counters.dropped_stale == 2


def test_batch_schema_carries_group_id_to_a_dense_group_index():
  trajs = [_traj(i, 5, 3) for i in range(4)]
  for t, g in zip(trajs, (41, 7, 41, 9)):
    t.group_id = g
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 16) as r:
    _fill(r.name, trajs)
    s = stream.TrajectoryStream(
        r, batch_size=4, seq_len=6, trainer_version=lambda: 3,
        staleness=StalenessPolicy(0), read_timeout=5.0, process_index=2)
    (batch,) = list(s.dataset)
  assert set(batch) == set(trajectory.TOKEN_FIELDS) | set(
      trajectory.ROW_FIELDS)
  for name, (dtype, _) in trajectory.TOKEN_FIELDS.items():
    assert batch[name].shape == (4, 6) and batch[name].dtype == dtype, name
  for name in trajectory.ROW_FIELDS:
    assert batch[name].shape == (4,) and batch[name].dtype == np.int32, name
  np.testing.assert_array_equal(batch["group_id"], [41, 7, 41, 9])
  # Dense per host (7 -> 0, 9 -> 1, 41 -> 2), offset by process 2 * B = 8.
  np.testing.assert_array_equal(batch["group_index"], [10, 8, 10, 9])
  np.testing.assert_array_equal(batch["prompt_id"], [100, 101, 102, 103])


def test_truncation_keeps_return_and_counts():
  trajs = [_traj(0, 12, 5), _traj(1, 6, 5), _traj(2, 20, 5), _traj(3, 8, 5)]
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 16) as r:
    _fill(r.name, trajs)
    s = stream.TrajectoryStream(
        r, batch_size=4, seq_len=8, trainer_version=lambda: 5,
        staleness=StalenessPolicy(None), overlong="truncate", read_timeout=5.0)
    (batch,) = list(s.dataset)
  assert s.counters.truncated == 2 and s.counters.dropped_overlong == 0
  np.testing.assert_array_equal(batch["length"], [12, 6, 20, 8])
  np.testing.assert_allclose(batch["rewards"].sum(1),
                             [t.total_reward for t in trajs])
  np.testing.assert_array_equal(batch["tokens"][0], trajs[0].tokens[:8])
  assert batch["attention_mask"].sum() == 8 + 6 + 8 + 8
  with pytest.raises(ValueError, match="overlong must be"):
    stream.PadToLength(8, stream.StreamCounters(), overlong="wrap")


def test_staleness_uses_current_trainer_version_and_state_round_trips():
  version = [3]
  trajs = [_traj(i, 5, 3) for i in range(6)]
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 16) as r:
    _fill(r.name, trajs)
    s = stream.TrajectoryStream(
        r, batch_size=2, seq_len=6, trainer_version=lambda: version[0],
        staleness=StalenessPolicy(1), read_timeout=5.0)
    it = iter(s.dataset)
    first = next(it)
    state = it.get_state()
    version[0] = 5  # The trainer stepped twice: the rest are too stale.
    assert list(it) == []
  np.testing.assert_array_equal(first["staleness"], [0, 0])
  assert s.counters.dropped_stale == 4 and s.counters.records_read == 6
  assert state["records_read"] == 2 and state["admitted"] == 2
  it.set_state(state)  # Counters come back (the ring itself cannot rewind).
  assert s.counters.records_read == 2 and s.counters.dropped_stale == 0


class _SamplerDied(RuntimeError):
  pass


def test_waiting_stream_polls_check_producers_and_times_out():
  calls = []

  def check():
    calls.append(1)
    if len(calls) == 2:
      raise _SamplerDied("sampler exited with code 1")

  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 12) as r:
    s = stream.TrajectoryStream(
        r, batch_size=1, seq_len=4, trainer_version=lambda: 0,
        staleness=StalenessPolicy(None), read_timeout=30.0,
        check_producers=check)
    with pytest.raises(_SamplerDied):
      next(iter(s.dataset))
    assert len(calls) == 2  # Once per second of waiting, not once at 30 s.
    assert 1.5 < s.counters.read_wait_s < 10
    quiet = stream.TrajectoryStream(
        r, batch_size=1, seq_len=4, trainer_version=lambda: 0,
        staleness=StalenessPolicy(None), read_timeout=0.3,
        check_producers=lambda: None)
    with pytest.raises(ring.RingEmptyError):
      next(iter(quiet.dataset))


def _produce_trajs(name, n):
  _fill(name, [_traj(i, 3 + i % 9, 4) for i in range(n)])


@pytest.mark.multiprocess
def test_cross_process_batches_feed_make_array_from_process_local_data():
  n, batch_size = 64, 8
  with ring.RingReader.create(num_lanes=1, lane_bytes=1 << 14) as r:
    p = _SPAWN.Process(target=_produce_trajs, args=(r.name, n))
    p.start()
    try:
      s = stream.TrajectoryStream(
          r, batch_size=batch_size, seq_len=16, trainer_version=lambda: 4,
          staleness=StalenessPolicy(0), read_timeout=60.0)
      batches = list(s.dataset)
    finally:
      p.join(timeout=60)
  assert p.exitcode == 0 and len(batches) == n // batch_size
  np.testing.assert_array_equal(
      np.concatenate([b["prompt_id"] for b in batches]), 100 + np.arange(n))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  sharding = jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("data"))
  arr = jax.make_array_from_process_local_data(sharding, batches[0]["tokens"])
  assert arr.shape == (batch_size, 16)
  np.testing.assert_array_equal(np.asarray(arr), batches[0]["tokens"])


# --- prompt side -------------------------------------------------------------


def test_prompt_iterator_state_round_trip_continues_identically():
  tasks = [f"task-{i}" for i in range(10)]
  it = prompts.prompt_iterator(tasks, seed=7)
  first_epoch = [next(it) for _ in range(10)]
  assert sorted(first_epoch) == sorted(tasks)  # One epoch = a permutation.
  assert first_epoch != tasks  # Shuffled.
  _ = [next(it) for _ in range(3)]
  state = it.get_state()
  expected = [next(it) for _ in range(15)]
  fresh = prompts.prompt_iterator(tasks, seed=7)
  fresh.set_state(state)
  assert [next(fresh) for _ in range(15)] == expected
  other = prompts.prompt_iterator(tasks, seed=8)
  assert [next(other) for _ in range(10)] != first_epoch


def test_prompt_shards_are_disjoint_and_finite_epochs_end():
  tasks = list(range(11))
  shards = [list(prompts.prompt_dataset(tasks, seed=0, num_epochs=1,
                                        shard_index=i, shard_count=3))
            for i in range(3)]
  assert sorted(sum(shards, [])) == tasks
  assert [len(s) for s in shards] == [4, 4, 3]
  assert len(list(prompts.prompt_dataset(tasks, seed=0, num_epochs=2))) == 22
  with pytest.raises(ValueError, match="no tasks"):
    prompts.prompt_dataset([], seed=0)
