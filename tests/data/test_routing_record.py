"""The trajectory record carries a MoE policy's routed experts (R3): codec,
episode record, batch row, and the dense (v1) records written before it."""

import struct

import numpy as np
import pytest

from sao_jax.data import trajectory as traj_lib


def _traj(n=7, m=3, k=2, seed=0):
  rng = np.random.default_rng(seed)
  return traj_lib.Trajectory(
      prompt_id=5, tokens=rng.integers(0, 100, n),
      action_mask=(np.arange(n) >= 3).astype(np.uint8),
      rollout_logp=rng.normal(size=n), policy_version=np.full(n, 2),
      rewards=np.eye(n)[-1], task="chain_sum",
      routed_experts=None if m == 0 else rng.integers(0, 300, (n, m, k)))


def _join(bufs):
  return b"".join(bytes(memoryview(b).cast("B")) for b in bufs)


@pytest.mark.parametrize("m", [0, 3])
def test_codec_round_trips_routed_experts(m):
  t = _traj(m=m)
  data = _join(traj_lib.encode(t))
  assert len(data) == 40 + (17 + 2 * m * 2) * 7 + len("chain_sum")
  back = traj_lib.decode(data)
  np.testing.assert_array_equal(back.tokens, t.tokens)
  np.testing.assert_array_equal(back.action_mask, t.action_mask)
  np.testing.assert_array_equal(back.rollout_logp, t.rollout_logp)
  if m:
    assert back.routed_experts.shape == (7, 3, 2)
    np.testing.assert_array_equal(back.routed_experts, t.routed_experts)
    assert back.routed_experts.max() >= 256  # Ids past a byte survive.
  else:
    assert back.routed_experts is None


def test_truncated_routing_is_refused():
  data = _join(traj_lib.encode(_traj()))
  with pytest.raises(ValueError, match="truncated or corrupted"):
    traj_lib.decode(data[:-20])


def test_version_1_dense_records_still_decode():
  t = _traj(m=0)
  task = t.task.encode()
  header = struct.pack("<4sHHIqqII", b"SAOT", 1, 0, 7, 5, -1, len(task), 0)
  body = b"".join(np.ascontiguousarray(getattr(t, f), d).tobytes()
                  for f, d in (("tokens", "<i4"), ("rollout_logp", "<f4"),
                               ("policy_version", "<i4"), ("rewards", "<f4"),
                               ("action_mask", "u1")))
  back = traj_lib.decode(header + b"\0" * 4 + body + task)
  np.testing.assert_array_equal(back.tokens, t.tokens)
  assert back.task == "chain_sum" and back.routed_experts is None


def test_episode_record_and_row_carry_experts():
  rec = traj_lib.EpisodeRecord()
  rec.add([1, 2, 3], 0, experts=np.full((3, 2, 2), 4))
  rec.add([9], 1, logp=[-0.5], version=1, experts=np.full((1, 2, 2), 7))

  class _Env:
    prompt_id, name = 3, "t"

  t = rec.trajectory(_Env())
  assert t.routed_experts.shape == (4, 2, 2)
  assert t.routed_experts[:, 0, 0].tolist() == [4, 4, 4, 7]
  row = traj_lib.pad_row(t, staleness=0, seq_len=6)
  assert row["routed_experts"].shape == (6, 2, 2)
  assert row["routed_experts"][:, 1, 1].tolist() == [4, 4, 4, 7, 0, 0]
  dense = traj_lib.pad_row(_traj(m=0), staleness=0, seq_len=6)
  assert "routed_experts" not in dense


def test_mismatched_routing_shape_is_refused():
  with pytest.raises(ValueError, match="routed_experts has shape"):
    traj_lib.Trajectory(prompt_id=0, tokens=[1, 2], action_mask=[0, 1],
                        rollout_logp=[0, 0], policy_version=[-1, 0],
                        rewards=[0, 1], routed_experts=np.zeros((3, 1, 2)))
