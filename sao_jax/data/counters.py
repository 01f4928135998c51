"""What the trainer's stream did to the records it read (never silent).

``StreamCounters`` is the stream's iterator state (``sao_jax.data.stream``:
the ring cannot rewind, so a checkpoint saves these counts) and the source of
the loop's stream scalars and summary (``train.metrics``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sao_jax.data.trajectory import Trajectory


@dataclasses.dataclass
class StreamCounters:
  """What the stream did to the records it read (never silent)."""

  records_read: int = 0
  action_tokens_read: int = 0  # Generated tokens of every record read.
  dropped_stale: int = 0
  dropped_overlong: int = 0
  truncated: int = 0
  staleness_sum: int = 0  # Over admitted records.
  staleness_max: int = 0
  admitted: int = 0
  multi_version: int = 0  # Admitted records sampled by more than one version.
  error_rows: int = 0  # ERROR trajectories (kept as rows with no action).
  dropped_future: int = 0  # Versions newer than the trainer's: not ours.
  read_wait_s: float = 0.0
  batch_tokens: int = 0  # Real (non-padding) tokens of the batches emitted.
  batch_slots: int = 0  # B * T of the batches emitted.
  pack_held: int = 0  # Admitted, held by the packer for the next batch.

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["staleness_mean"] = self.staleness_sum / max(1, self.admitted)
    d["padding_frac"] = 1.0 - self.batch_tokens / max(1, self.batch_slots)
    return d

  def count_batch(self, batch: dict) -> dict:
    """Counts an emitted batch's real tokens and slots (padding fraction)."""
    mask = np.asarray(batch["attention_mask"])
    self.batch_tokens += int(mask.sum())
    self.batch_slots += int(mask.size)
    return batch

  def count_restale(self, staleness: int) -> None:
    """A held trajectory (admitted at ``staleness``) went stale: dropped."""
    self.admitted -= 1
    self.staleness_sum -= staleness
    self.dropped_stale += 1

  def count_read(self, traj: Trajectory) -> None:
    self.records_read += 1
    self.action_tokens_read += traj.num_action_tokens

  def count_stale(self) -> None:
    self.dropped_stale += 1

  def count_admitted(self, traj: Trajectory, staleness: int) -> None:
    self.admitted += 1
    self.staleness_sum += staleness
    self.staleness_max = max(self.staleness_max, staleness)
    acts = traj.policy_version[traj.action_mask.astype(bool)]
    if acts.size and acts.min() != acts.max():
      self.multi_version += 1

  def load(self, state: dict) -> None:
    for f in dataclasses.fields(self):
      if f.name in state:
        setattr(self, f.name, type(getattr(self, f.name))(state[f.name]))
