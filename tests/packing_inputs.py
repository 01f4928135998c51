"""Packed and unpacked batches of the same trajectories, for the packing tests
(test_packing.py, test_packing_step.py)."""

import grain
import numpy as np

from sao_jax.data import packing
from sao_jax.data import stream
from sao_jax.data import trajectory
from sao_jax.data.trajectory import NO_VERSION
from sao_jax.data.trajectory import Trajectory

TOL = 1e-5


def traj(rng, i: int, length: int, version: int = 5, group: int = -1):
  """Prompt of 3, then two actions with an observation between (multi-turn
  action mask), per-token versions, a mid and a terminal reward."""
  mask = np.zeros(length, np.uint8)
  cut = 3 + max(1, (length - 3) // 2)
  mask[3:cut] = 1
  mask[min(cut + 2, length - 1):] = 1  # Observation: 2 tokens after cut.
  versions = np.where(mask > 0, version + rng.integers(0, 2, length),
                      NO_VERSION)
  rewards = np.zeros(length, np.float32)
  acts = np.flatnonzero(mask)
  rewards[acts[-1]] = rng.normal()
  rewards[acts[0]] = 0.25 * rng.normal()
  rewards[cut] = 0.5  # On the observation: credited to the action before.
  return Trajectory(
      prompt_id=i, tokens=rng.integers(1, 30, length),
      action_mask=mask, rollout_logp=np.where(mask > 0, -rng.random(length),
                                              0.0),
      policy_version=versions, rewards=rewards, task="t",
      group_id=i if group < 0 else group)


def trajs(seed=0, n=11, lo=6, hi=15, groups=None):
  rng = np.random.default_rng(seed)
  return [traj(rng, i, int(rng.integers(lo, hi + 1)),
                group=-1 if groups is None else i % groups)
          for i in range(n)]


def unpacked(trajs, seq_len):
  rows = [trajectory.pad_row(t, 1, seq_len) for t in trajs]
  batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
  return trajectory.with_group_index(batch)


def packed(trajs, batch_size, seq_len, max_segments, **kw):
  """Every packed batch of ``trajs`` (list source, staleness 1)."""
  counters = stream.StreamCounters()
  ds = grain.MapDataset.source([(t, 1) for t in trajs]).to_iter_dataset()
  ds = stream.to_batches(ds, counters, batch_size=batch_size,
                         seq_len=seq_len, overlong="truncate",
                         pack_segments=max_segments,
                         restale=kw.pop("restale", lambda t: 1),
                         drop_remainder=False, **kw)
  return list(ds), counters


def by_trajectory(x, batch):
  """{prompt_id: x's values on that trajectory's tokens} (packed or not)."""
  x = np.asarray(x)
  out = {}
  if packing.is_packed(batch):
    seg = np.asarray(batch["segment_ids"])
    for b in range(seg.shape[0]):
      for s in range(batch["length"].shape[1]):
        if batch["length"][b, s] > 0:
          out[int(batch["prompt_id"][b, s])] = x[b][seg[b] == s + 1]
  else:
    for b in range(x.shape[0]):
      n = min(int(batch["length"][b]), x.shape[1])
      out[int(batch["prompt_id"][b])] = x[b, :n]
  return out


def same_per_trajectory(a, batch_a, b, batch_b, tol=TOL):
  da, db = by_trajectory(a, batch_a), by_trajectory(b, batch_b)
  assert sorted(da) == sorted(db)
  for k in da:
    np.testing.assert_allclose(da[k], db[k], atol=tol, rtol=tol,
                               err_msg=f"trajectory {k}")


def token_values(batch, seed=3):
  """Critic values that depend only on (trajectory, position): the same in
  the packed and the unpacked layout."""
  pid = np.asarray(batch["prompt_id"])
  if packing.is_packed(batch):
    seg = np.asarray(batch["segment_ids"])
    slot = np.maximum(seg - 1, 0)
    pid = np.take_along_axis(pid, slot, axis=1)
    pos = np.asarray(batch["positions"])
  else:
    pid = np.broadcast_to(pid[:, None], batch["tokens"].shape)
    pos = np.broadcast_to(np.arange(batch["tokens"].shape[1]),
                          batch["tokens"].shape)
  return np.sin(seed * pid + 0.37 * pos).astype(np.float32)
