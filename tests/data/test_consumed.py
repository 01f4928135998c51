"""The trainer's record of consumed episode numbers (data/consumed.py)."""

import numpy as np
import pytest

from sao_jax.data import consumed
from sao_jax.data.trajectory import Trajectory


def _traj(group_id):
  z = np.zeros(2)
  return Trajectory(prompt_id=0, tokens=z, action_mask=z, rollout_logp=z,
                    policy_version=z, rewards=z, group_id=group_id)


def test_watermark_and_set_above_follow_out_of_order_reads():
  c = consumed.ConsumedEpisodes()
  for e in (1, 0, 3, 5, 2):
    c.add(_traj(e))
  assert c.watermark == 4 and c.above == {5} and c.count == 5
  assert 3 in c and 5 in c and 4 not in c
  assert c.to_meta() == {"watermark": 4, "above": [5]}
  start, skip = c.resume_plan()
  assert (start, skip, c.lost) == (4, frozenset({5}), 0)
  c.add(_traj(5))  # Read twice: counted, not added.
  assert c.duplicates == 1 and c.count == 5


def test_group_ids_of_other_hosts_and_rollouts_map_to_episodes():
  # Host 1 of 2, 3 rollouts per draw: group id = draw * 2 + 1; the k-th
  # record of a draw read is episode draw * 3 + k.
  c = consumed.ConsumedEpisodes(n_rollouts=3, process_count=2)
  for gid in (3, 1, 1, 3, 1, 3):  # Draws 1 and 0, interleaved.
    c.add(_traj(gid))
  assert c.watermark == 6 and not c.above
  with pytest.raises(ValueError, match="group_id"):
    c.add(_traj(-1))


def test_partly_read_groups_are_skipped_whole_and_counted_lost():
  c = consumed.ConsumedEpisodes(n_rollouts=2)
  for gid in (0, 0, 1, 3, 3, 4):  # Draw 1 and draw 4 read only partly.
    c.add(_traj(gid))
  assert c.watermark == 3 and c.above == {6, 7, 8}
  start, skip = c.resume_plan()
  assert start == 4 and skip == frozenset({6, 7, 8, 9})
  assert c.lost == 2  # Episodes 3 and 9: never trained on, counted.


def test_meta_round_trip_and_old_checkpoints():
  c = consumed.ConsumedEpisodes(7, [9, 12], process_count=2)
  meta = {"episodes_consumed": 20, consumed.META_KEY: [
      {"watermark": 1, "above": []}, c.to_meta()]}
  back = consumed.from_meta(meta, n_rollouts=1, process_index=1,
                             process_count=2)
  assert (back.watermark, back.above) == (7, {9, 12})
  # A checkpoint from before the record: this host's share of the count.
  old = consumed.from_meta({"episodes_consumed": 20}, n_rollouts=1,
                            process_index=1, process_count=2)
  assert (old.watermark, old.above) == (10, set())
  assert consumed.from_meta({"episodes_consumed": 0}, n_rollouts=1,
                            process_index=0, process_count=1).count == 0
  with pytest.raises(ValueError, match="same number of processes"):
    consumed.from_meta(meta, n_rollouts=1, process_index=0,
                       process_count=4)
  assert consumed.all_hosts(consumed.ConsumedEpisodes(3, [5])) == [
      {"watermark": 3, "above": [5]}]
