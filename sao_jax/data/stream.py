"""The trainer's input: a grain ``IterDataset`` over the trajectory ring.

Pipeline (DESIGN.md §1, §4)::

    RingDataset            Trajectory records decoded from the ring
    -> StalenessFilter     drop staleness > max_staleness (counted, logged)
    -> .map(PadToLength)   fixed [T] arrays; over-long records dropped or
                           truncated (counted)
    -> .batch(B)           dict of NumPy arrays [B, T] / [B]

The batches are process-local, ready for
``jax.make_array_from_process_local_data``. Keys: ``tokens int32[B,T]``,
``action_mask uint8[B,T]``, ``rollout_logp float32[B,T]``,
``policy_version int32[B,T]``, ``rewards float32[B,T]``,
``attention_mask bool[B,T]`` (valid tokens), ``prompt_id int64[B]``,
``staleness int32[B]``, ``length int32[B]`` (tokens before padding/truncation).

Over-long records (more than T tokens): ``overlong="drop"`` (default) drops
them; ``overlong="truncate"`` keeps the first T tokens and moves the rewards of
the cut tail onto the last kept action token so the return is preserved. Both
are counted in ``StreamCounters``.

The ring cannot rewind, so iterator state is the counters only: restoring a
checkpoint continues with whatever the sampler publishes next.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from absl import logging
import grain
import numpy as np

from sao_jax.ipc import codec
from sao_jax.ipc import ring as ring_lib
from sao_jax.trajectory import NO_VERSION
from sao_jax.trajectory import Trajectory


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
  read_wait_s: float = 0.0

  def as_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["staleness_mean"] = self.staleness_sum / max(1, self.admitted)
    return d

  def load(self, state: dict) -> None:
    for f in dataclasses.fields(self):
      if f.name in state:
        setattr(self, f.name, type(getattr(self, f.name))(state[f.name]))


class RingDataset(grain.IterDataset):
  """Trajectories read from a ``RingReader`` (the single consumer)."""

  def __init__(
      self,
      reader: ring_lib.RingReader,
      counters: StreamCounters,
      read_timeout: float | None = None,
      check_producers: Callable[[], None] | None = None,
  ):
    super().__init__()
    self._reader = reader
    self._counters = counters
    self._timeout = read_timeout
    self._check = check_producers

  def __iter__(self) -> grain.DatasetIterator:
    return _RingIterator(self._reader, self._counters, self._timeout,
                         self._check)


class _RingIterator(grain.DatasetIterator):

  def __init__(self, reader, counters, timeout, check=None):
    super().__init__()
    self._reader = reader
    self._counters = counters
    self._timeout = timeout
    self._check = check

  def _read(self):
    """Reads one record; while waiting, polls ``check`` once a second.

    ``check`` raises when the producers are gone (e.g. the sampler process
    died), so the trainer fails fast instead of waiting out the timeout.
    """
    if self._check is None:
      return self._reader.read(timeout=self._timeout)
    deadline = (None if self._timeout is None
                else time.monotonic() + self._timeout)
    while True:
      wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
      try:
        return self._reader.read(timeout=max(wait, 0.0))
      except ring_lib.RingEmptyError:
        if deadline is not None and time.monotonic() >= deadline:
          raise
        self._check()

  def __next__(self) -> Trajectory:
    t0 = time.perf_counter()
    try:
      rec = self._read()
    except ring_lib.RingDrained:
      raise StopIteration from None
    finally:
      self._counters.read_wait_s += time.perf_counter() - t0
    self._counters.records_read += 1
    traj = codec.decode(rec.data)
    self._counters.action_tokens_read += traj.num_action_tokens
    return traj

  def get_state(self) -> dict:
    return self._counters.as_dict()

  def set_state(self, state: dict) -> None:
    self._counters.load(state)


class StalenessFilter(grain.IterDataset):
  """Drops trajectories with staleness > max_staleness (DESIGN §4).

  Staleness = trainer version - the trajectory's oldest action-token version,
  with the trainer version read from ``trainer_version()`` when the record is
  consumed. Yields ``(trajectory, staleness)``.
  """

  def __init__(
      self,
      parent: grain.IterDataset,
      trainer_version: Callable[[], int],
      max_staleness: int | None,
      counters: StreamCounters,
  ):
    super().__init__(parent)
    self._version = trainer_version
    self._max = max_staleness
    self._counters = counters

  def __iter__(self) -> grain.DatasetIterator:
    return _StalenessIterator(self._parent.__iter__(), self)


class _StalenessIterator(grain.DatasetIterator):

  def __init__(self, parent: grain.DatasetIterator, ds: StalenessFilter):
    super().__init__(parent)
    self._ds = ds

  def __next__(self) -> tuple[Trajectory, int]:
    c = self._ds._counters  # pylint: disable=protected-access
    while True:
      traj = next(self._parent)
      version = int(self._ds._version())  # pylint: disable=protected-access
      staleness = traj.staleness(version)
      limit = self._ds._max  # pylint: disable=protected-access
      if limit is not None and staleness > limit:
        c.dropped_stale += 1
        if c.dropped_stale in (1, 10, 100) or c.dropped_stale % 1000 == 0:
          logging.warning(
              "Stream dropped %d stale trajectories so far (this one: "
              "staleness %d > max_staleness %d at trainer version %d).",
              c.dropped_stale, staleness, limit, version,
          )
        continue
      c.admitted += 1
      c.staleness_sum += staleness
      c.staleness_max = max(c.staleness_max, staleness)
      acts = traj.policy_version[traj.action_mask.astype(bool)]
      if acts.size and acts.min() != acts.max():
        c.multi_version += 1
      return traj, staleness

  def get_state(self) -> dict:
    return self._parent.get_state()

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state)


class PadToLength(grain.transforms.Map):
  """(Trajectory, staleness) -> dict of fixed-length [T] arrays."""

  def __init__(self, seq_len: int, counters: StreamCounters, *,
               overlong: str = "drop", pad_id: int = 0):
    if overlong not in ("drop", "truncate"):
      raise ValueError(
          f"overlong must be 'drop' or 'truncate', got {overlong!r}."
      )
    self._t = seq_len
    self._counters = counters
    self._overlong = overlong
    self._pad_id = pad_id

  def map(self, element):
    traj, staleness = element
    t, n = self._t, traj.length
    keep = min(n, t)
    rewards = traj.rewards[:keep].copy()
    if n > t:
      self._counters.truncated += 1
      tail = float(traj.rewards[t:].sum())
      acts = np.flatnonzero(traj.action_mask[:t])
      rewards[acts[-1] if acts.size else t - 1] += tail
    out = {
        "tokens": np.full(t, self._pad_id, np.int32),
        "action_mask": np.zeros(t, np.uint8),
        "rollout_logp": np.zeros(t, np.float32),
        "policy_version": np.full(t, NO_VERSION, np.int32),
        "rewards": np.zeros(t, np.float32),
        "attention_mask": np.zeros(t, bool),
    }
    out["tokens"][:keep] = traj.tokens[:keep]
    out["action_mask"][:keep] = traj.action_mask[:keep]
    out["rollout_logp"][:keep] = traj.rollout_logp[:keep]
    out["policy_version"][:keep] = traj.policy_version[:keep]
    out["rewards"][:keep] = rewards
    out["attention_mask"][:keep] = True
    out["prompt_id"] = np.int64(traj.prompt_id)
    out["staleness"] = np.int32(staleness)
    out["length"] = np.int32(n)
    return out


class _OverlongFilter(grain.transforms.Filter):
  """Drops (and counts) records longer than T when overlong='drop'."""

  def __init__(self, seq_len: int, counters: StreamCounters):
    self._t = seq_len
    self._counters = counters

  def filter(self, element) -> bool:
    traj, _ = element
    if traj.length <= self._t:
      return True
    self._counters.dropped_overlong += 1
    if self._counters.dropped_overlong in (1, 10, 100):
      logging.warning(
          "Stream dropped %d over-long trajectories so far (this one: %d "
          "tokens > seq_len %d); raise seq_len or use overlong='truncate'.",
          self._counters.dropped_overlong, traj.length, self._t,
      )
    return False


class TrajectoryStream:
  """Builds the pipeline and exposes its counters.

  Usage::

    stream = TrajectoryStream(reader, batch_size=8, seq_len=512,
                              trainer_version=lambda: state.step,
                              max_staleness=4)
    for batch in stream.dataset: ...
    stream.counters.as_dict()
  """

  def __init__(
      self,
      reader: ring_lib.RingReader,
      *,
      batch_size: int,
      seq_len: int,
      trainer_version: Callable[[], int],
      max_staleness: int | None,
      overlong: str = "drop",
      pad_id: int = 0,
      read_timeout: float | None = None,
      drop_remainder: bool = True,
      check_producers: Callable[[], None] | None = None,
  ):
    """See the module docstring for the pipeline.

    Args:
      reader: The ring's consumer.
      batch_size: Rows per batch (process-local).
      seq_len: T; shorter records are padded, longer ones see ``overlong``.
      trainer_version: Returns the trainer's current policy version.
      max_staleness: Drop records staler than this (DESIGN §4); None keeps all.
      overlong: "drop" or "truncate" (see the module docstring).
      pad_id: Token id of padding.
      read_timeout: Seconds to wait for a record before ring.RingEmptyError;
        None waits forever.
      drop_remainder: Drop a last partial batch when the ring drains.
      check_producers: Called about once a second while waiting for a record;
        raise from it to abort (e.g. when the sampler process died).
    """
    self.counters = StreamCounters()
    ds = RingDataset(reader, self.counters, read_timeout, check_producers)
    ds = StalenessFilter(ds, trainer_version, max_staleness, self.counters)
    if overlong == "drop":
      ds = ds.filter(_OverlongFilter(seq_len, self.counters))
    ds = ds.map(PadToLength(seq_len, self.counters, overlong=overlong,
                            pad_id=pad_id))
    self.dataset: grain.IterDataset = ds.batch(
        batch_size, drop_remainder=drop_remainder
    )

  def log_counters(self) -> dict:
    """Logs and returns the counters (call once per logging step)."""
    d = self.counters.as_dict()
    logging.info("Trajectory stream: %s", d)
    return d
