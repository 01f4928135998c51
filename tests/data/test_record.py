"""The stream recorder and the replay reader (sao_jax/data/record.py)."""

import numpy as np
import pytest

from sao_jax.data import trajectory as traj_lib
from sao_jax.data import record

B, T = 2, 8


def _traj(i: int, versions=(0, 0)) -> traj_lib.Trajectory:
  n = 6
  mask = np.array([0, 0, 1, 1, 0, 0], np.uint8)
  pv = np.full(n, traj_lib.NO_VERSION, np.int32)
  pv[2:4] = versions
  rewards = np.zeros(n, np.float32)
  rewards[3] = float(i)
  return traj_lib.Trajectory(
      prompt_id=i, tokens=np.arange(n) + i, action_mask=mask,
      rollout_logp=np.linspace(-1, 0, n).astype(np.float32) * i,
      policy_version=pv, rewards=rewards, task="t", group_id=i)


def _record_steps(recorder, first_id, steps, stale_every=0):
  """Feeds ``steps`` steps of B kept entries (plus a stale one every
  ``stale_every`` entries) as the live stream would; returns the ids fed."""
  fed, i = [], first_id
  for _ in range(steps):
    kept = 0
    while kept < B:
      stale = bool(stale_every) and i % stale_every == 0
      recorder.add(_traj(i), 7 if stale else 1, not stale)
      fed.append((recorder.step, i, not stale))
      kept += not stale
      i += 1
    recorder.batch_done({})
  return fed, i


def _all_entries(directory):
  out = []
  for _, _, path in record.list_shards(directory):
    out += [(e.step, e.traj.prompt_id, e.kept)
            for e in record.read_shard(path)]
  return out


def test_entry_round_trip():
  traj = _traj(3, versions=(1, 2))
  e = record.decode_entry(record.encode_entry(record.Entry(5, 2, False, traj)))
  assert (e.step, e.staleness, e.kept) == (5, 2, False)
  for name in ("tokens", "action_mask", "rollout_logp", "policy_version",
               "rewards"):
    np.testing.assert_array_equal(getattr(e.traj, name), getattr(traj, name))
  assert (e.traj.prompt_id, e.traj.task, e.traj.group_id) == (3, "t", 3)


def test_shards_cut_every_n_and_at_checkpoints(tmp_path):
  d = str(tmp_path)
  rec = record.StreamRecorder(d, start_step=0, shard_steps=4,
                              checkpoint_every=3)
  fed, _ = _record_steps(rec, 0, 7, stale_every=3)
  rec.close()
  spans = [(s, e) for s, e, _ in record.list_shards(d)]
  assert spans == [(0, 3), (3, 4), (4, 6), (6, 7)]
  assert record.recorded_range(d) == (0, 7)
  # Every entry, in consumption order, with its step and stale marking.
  assert _all_entries(d) == fed
  assert any(not kept for _, _, kept in fed)


def test_resume_truncates_and_appends(tmp_path):
  d = str(tmp_path)
  rec = record.StreamRecorder(d, start_step=0, shard_steps=4)
  fed, next_id = _record_steps(rec, 0, 6, stale_every=5)
  # Killed at step 6 without closing: steps [4, 6) sit in an open shard.
  assert [e for _, e, _ in record.list_shards(d, include_open=True)] == [
      4, None]
  # Resumed from a checkpoint at step 2: [0, 4) is cut back to [0, 2), the
  # open shard goes; steps from 2 on are recorded again.
  rec2 = record.StreamRecorder(d, start_step=2, shard_steps=4)
  assert [(s, e) for s, e, _ in record.list_shards(d, include_open=True)] == [
      (0, 2)]
  fed2, _ = _record_steps(rec2, next_id, 3)
  rec2.close()
  assert [(s, e) for s, e, _ in record.list_shards(d)] == [(0, 2), (2, 4),
                                                           (4, 5)]
  assert _all_entries(d) == [f for f in fed if f[0] < 2] + fed2


def test_gap_is_reported(tmp_path):
  d = str(tmp_path)
  rec = record.StreamRecorder(d, start_step=0, shard_steps=2)
  _record_steps(rec, 0, 2)
  rec.close()
  rec = record.StreamRecorder(d, start_step=4, shard_steps=2)
  _record_steps(rec, 100, 2)
  rec.close()
  with pytest.raises(record.RecordError, match=r"misses steps \[2, 4\)"):
    record.recorded_range(d)


def test_replay_stream_batches_and_counters(tmp_path):
  d = str(tmp_path)
  rec = record.StreamRecorder(d, start_step=0, shard_steps=2)
  fed, _ = _record_steps(rec, 0, 5, stale_every=4)
  rec.close()
  replay = record.ReplayStream(d, start=1, stop=4, batch_size=B, seq_len=T,
                               overlong="truncate", pad_id=0)
  batches = list(replay.dataset)
  assert len(batches) == 3
  for step, batch in zip(range(1, 4), batches):
    want = [i for s, i, kept in fed if s == step and kept]
    assert batch["prompt_id"].tolist() == want
    assert batch["tokens"].shape == (B, T)
    np.testing.assert_array_equal(batch["staleness"], [1] * B)
  window = [f for f in fed if 1 <= f[0] < 4]
  c = replay.counters
  assert c.records_read == len(window)
  assert c.dropped_stale == sum(not k for _, _, k in window) > 0
  assert c.admitted == 3 * B
  assert c.action_tokens_read == 2 * len(window)


def test_replay_outside_the_recording_fails(tmp_path):
  d = str(tmp_path)
  rec = record.StreamRecorder(d, start_step=0, shard_steps=2)
  _record_steps(rec, 0, 3)
  rec.close()
  with pytest.raises(record.RecordError, match=r"holds steps \[0, 3\)"):
    record.ReplayStream(d, start=1, stop=5, batch_size=B, seq_len=T,
                        overlong="truncate", pad_id=0)
  with pytest.raises(record.RecordError, match="another batch size"):
    list(record.ReplayStream(d, start=0, stop=3, batch_size=B + 1, seq_len=T,
                             overlong="truncate", pad_id=0).dataset)


def test_config_differences_name_the_changed_keys(tmp_path):
  import ml_collections  # pylint: disable=g-import-not-at-top
  config = ml_collections.ConfigDict(
      {"rl": {"loss": "grpo", "eps": (0.2, 0.28)}, "train": {"seed": 0}})
  d = str(tmp_path)
  record.StreamRecorder(d, start_step=0, shard_steps=2, config=config)
  assert record.config_differences(d, config) == []
  config.rl.loss = "grpo_dis"
  config.train.seed = 1
  assert record.config_differences(d, config) == ["rl.loss", "train.seed"]
  assert record.config_differences(str(tmp_path / "none"), config) == []
  assert record.differing_keys({"a": {"b": 1}}, {"a": {"c": 1}}) == [
      "a.b", "a.c"]
