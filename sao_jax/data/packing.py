"""Sequence packing: several trajectories back to back in one ``[T]`` row.

The packed form of the trainer's batch (docs/design/data_path.md "Packed rows"):
the stream's ``[B, T]`` shape is kept, but a row holds up to ``S`` (static,
``train.pack_max_segments``) trajectories, each one a *segment*:

- ``segment_ids`` int32[B, T]: 0 on padding, 1, 2, ... for the row's
  trajectories in order (the attention contract of ``models.transformer``:
  a token sees the earlier tokens of its own segment only);
- ``positions`` int32[B, T]: RoPE positions, restarting at 0 per segment;
- the per-trajectory fields (``trajectory.ROW_FIELDS``) become ``[B, S]``,
  slot ``s`` of row ``b`` describing segment ``s + 1``; an empty slot has
  ``length`` 0, ``group_id`` -1, ``staleness`` -1 and ``group_index`` -1;
- a MoE policy's ``routed_experts`` int32[B, T, M, k] (routing replay, R3)
  is packed as the per-token fields are (0 on padding).

``PackedBatches`` packs online, first fit: each trajectory goes into the
first row with room (tokens and a free slot); one that fits nowhere is held
for the next batch, and the batch is emitted once ``B`` trajectories are held
or no row has room left. A held trajectory is always trained in the next
batch (it fits an empty row), after its staleness is checked again against
the trainer version of that batch (``StalenessPolicy``: dropped and counted
when it no longer qualifies), and ``ConsumedEpisodes`` does not count it
consumed until its batch is emitted (``hold`` / ``release``), so a checkpoint
between the two batches neither loses nor repeats it. A trajectory longer
than ``T`` is handled as unpacked rows handle it (dropped or truncated
upstream) and then fills a row alone.
"""

from __future__ import annotations

from typing import Any, Callable

import grain
import numpy as np

from sao_jax.data import trajectory as traj_lib
from sao_jax.data.trajectory import Trajectory

# Losses that reduce per row (sequence means, a per-row normaliser, sequence
# ratios): a packed row would mix trajectories in them (config_validation).
PER_ROW_LOSSES = ("grpo", "dr_grpo", "gspo")


def pack_segments(config: Any) -> int:
  """Trajectories per row of ``config`` (``train.pack``); 0: unpacked."""
  return int(config.train.pack_max_segments) if config.train.pack else 0


def trajectories_per_step_bound(config: Any) -> int:
  """The most trajectories one step's (global) batch can hold: the group
  bound of the estimators and the sampler's admission unit."""
  return int(config.train.batch_size) * max(1, pack_segments(config))


# Per-trajectory fields of a packed batch, [B, S], and their empty-slot value.
SLOT_FIELDS = {"prompt_id": 0, "group_id": -1, "staleness": -1, "length": 0,
               "group_index": -1}
assert set(SLOT_FIELDS) == set(traj_lib.ROW_FIELDS)


def is_packed(batch: dict) -> bool:
  """Whether ``batch`` is in the packed form (has ``segment_ids``)."""
  return "segment_ids" in batch


def pack_rows(rows: list[list[dict[str, np.ndarray]]], seq_len: int,
              max_segments: int, pad_id: int = 0) -> dict[str, np.ndarray]:
  """The packed batch of ``rows`` (each a list of unpadded trajectory rows,
  ``PadToLength(trim=True)``'s output), without ``group_index``."""
  b, t, s = len(rows), seq_len, max_segments
  batch = {name: np.full((b, t), pad_id if fill is None else fill, dtype)
           for name, (dtype, fill) in traj_lib.TOKEN_FIELDS.items()}
  batch["segment_ids"] = np.zeros((b, t), np.int32)
  batch["positions"] = np.zeros((b, t), np.int32)
  routed = [seg["routed_experts"] for segs in rows for seg in segs
            if "routed_experts" in seg]
  if routed:  # A MoE policy's routing (R3), packed like the token fields.
    batch["routed_experts"] = np.zeros((b, t, *routed[0].shape[1:]), np.int32)
  for name, fill in SLOT_FIELDS.items():
    if name != "group_index":
      batch[name] = np.full((b, s), fill, np.int32)
  for i, segments in enumerate(rows):
    if len(segments) > s:
      raise ValueError(f"Row {i} holds {len(segments)} trajectories; at "
                       f"most {s} (train.pack_max_segments) fit.")
    start = 0
    for j, seg in enumerate(segments):
      n = len(seg["tokens"])
      if start + n > t:
        raise ValueError(f"Row {i}'s trajectories hold {start + n} tokens; "
                         f"at most {t} (train.max_seq_len) fit.")
      for name in traj_lib.TOKEN_FIELDS:
        batch[name][i, start:start + n] = seg[name]
      if routed:
        batch["routed_experts"][i, start:start + n] = seg["routed_experts"]
      batch["segment_ids"][i, start:start + n] = j + 1
      batch["positions"][i, start:start + n] = np.arange(n)
      for name in SLOT_FIELDS:
        if name != "group_index":
          batch[name][i, j] = seg[name]
      start += n
  return batch


def with_slot_group_index(batch: dict[str, np.ndarray],
                          process_index: int = 0) -> dict[str, np.ndarray]:
  """``batch`` plus ``group_index`` [B, S]: the packed counterpart of
  ``trajectory.with_group_index`` (filled slots of one ``group_id`` share an
  index, dense per host and offset by ``process_index * B * S``; -1 on empty
  slots)."""
  valid = batch["length"] > 0
  index = np.full(batch["length"].shape, -1, np.int32)
  _, inverse = np.unique(batch["group_id"][valid], return_inverse=True)
  index[valid] = inverse.astype(np.int32) + process_index * valid.size
  return {**batch, "group_index": index}


def restale(trainer_version: Callable[[], int],
            policy: traj_lib.StalenessPolicy, traj: Trajectory) -> int | None:
  """A held trajectory's staleness now, or None if ``policy`` drops it."""
  staleness = traj.staleness(int(trainer_version()))
  return staleness if policy.keeps(staleness) else None


class PackedBatches(grain.IterDataset):
  """(trajectory, staleness) elements -> packed ``[B, T]`` batches.

  See the module docstring. ``to_row`` makes an unpadded row of one element
  (``stream.PadToLength`` with ``trim=True``); ``restale(traj)`` gives a held
  trajectory's staleness at the next batch, or None when the staleness policy
  no longer keeps it; ``consumed`` (``consumed.ConsumedEpisodes``) is told
  which episodes are held; ``counters`` (``stream.StreamCounters``) count
  held and re-checked trajectories.
  """

  def __init__(self, parent: grain.IterDataset, *, batch_size: int,
               seq_len: int, max_segments: int,
               to_row: Callable[[tuple[Trajectory, int]], dict],
               counters: Any, restale: Callable[[Trajectory], int | None],
               consumed: Any = None, pad_id: int = 0,
               drop_remainder: bool = True, process_index: int = 0):
    super().__init__(parent)
    if max_segments < 1:
      raise ValueError(f"max_segments must be >= 1, got {max_segments}.")
    self.batch_size, self.seq_len = int(batch_size), int(seq_len)
    self.max_segments = int(max_segments)
    self.to_row, self.counters, self.restale = to_row, counters, restale
    self.consumed, self.pad_id = consumed, pad_id
    self.drop_remainder, self.process_index = drop_remainder, process_index

  def __iter__(self) -> grain.DatasetIterator:
    return _PackedIterator(self._parent.__iter__(), self)


class _PackedIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, ds: PackedBatches):
    super().__init__(parent)
    self._ds = ds
    self._held: list[tuple[Trajectory, dict]] = []

  def _hold(self, traj: Trajectory, row: dict) -> None:
    self._held.append((traj, row))
    self._ds.counters.pack_held += 1
    if self._ds.consumed is not None:
      self._ds.consumed.hold(traj.episode)

  def _take_held(self) -> list[tuple[Trajectory, dict]]:
    """The held trajectories still kept at this batch, longest first."""
    ds, kept = self._ds, []
    for traj, row in self._held:
      ds.counters.pack_held -= 1
      if ds.consumed is not None:
        ds.consumed.release(traj.episode)
      staleness = ds.restale(traj)
      if staleness is None:
        ds.counters.count_restale(int(row["staleness"]))
        continue
      row["staleness"] = np.int32(staleness)
      kept.append((traj, row))
    self._held = []
    return sorted(kept, key=lambda e: -len(e[1]["tokens"]))

  def __next__(self) -> dict[str, np.ndarray]:
    ds = self._ds
    b, t, s = ds.batch_size, ds.seq_len, ds.max_segments
    rows: list[list[dict]] = [[] for _ in range(b)]
    used = [0] * b
    pending = self._take_held()
    drained = False
    while len(self._held) < b:
      if pending:
        traj, row = pending.pop(0)
      else:
        if all(len(r) == s or u == t for r, u in zip(rows, used)):
          break
        try:
          element = next(self._parent)
        except StopIteration:
          drained = True
          break
        traj, row = element[0], ds.to_row(element)
      n = len(row["tokens"])
      fit = next((i for i in range(b) if used[i] + n <= t and len(rows[i]) < s),
                 None)
      if fit is None:
        self._hold(traj, row)
        continue
      rows[fit].append(row)
      used[fit] += n
    if drained and (ds.drop_remainder or not any(rows)):
      raise StopIteration
    batch = pack_rows(rows, t, s, ds.pad_id)
    return with_slot_group_index(batch, ds.process_index)

  def get_state(self) -> dict:
    return self._parent.get_state()

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state)
