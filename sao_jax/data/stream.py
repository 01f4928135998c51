"""The trainer's input: a grain ``IterDataset`` over the trajectory ring.

Pipeline (docs/design/data_path.md "Staleness")::

    RingDataset            Trajectory records decoded from the ring
    -> StalenessFilter     drop what the StalenessPolicy does not keep
                           (counted, logged)
    -> .map(PadToLength)   fixed [T] rows (``trajectory.pad_row``); over-long
                           records dropped or truncated (counted)
    -> .batch(B)           dict of NumPy arrays [B, T] / [B]
    -> .map(group index)   ``group_index`` [B] from the rows' ``group_id``
       (with ``pack``: ``packing.PackedBatches`` instead of these two, rows
       holding several trajectories; ``sao_jax.data.packing``)
    -> .map(global batch)  with ``batch_sharding``: global ``jax.Array``s on
                           the mesh, every host's rows (``make_global_batch``)

Their keys are the batch schema of ``sao_jax.data.trajectory``
(``TOKEN_FIELDS`` [B, T] and ``ROW_FIELDS`` [B]); without ``batch_sharding``
the batches stay process-local NumPy arrays.

Over-long records (more than T tokens): ``overlong="drop"`` (default) drops
them; ``overlong="truncate"`` keeps the first T tokens and moves the rewards of
the cut tail onto the last kept action token so the return is preserved. Both
are counted in ``StreamCounters``.

The ring cannot rewind, so iterator state is the counters only: restoring a
checkpoint continues with whatever the sampler publishes next (a sampler
resumed after the episodes the stream had consumed, ``consumed``).
"""

from __future__ import annotations

import collections
import functools
import time
from typing import Any, Callable, Protocol

from absl import logging
import grain
import jax
import numpy as np

from sao_jax.data import consumed as consumed_lib
from sao_jax.data import packing
from sao_jax.data import trajectory as traj_lib
from sao_jax.data.counters import StreamCounters
from sao_jax.data.trajectory import Trajectory
from sao_jax.ipc import ring as ring_lib

# How every MapDataset of the project turns into an IterDataset: its elements
# are in memory (or a local ArrayRecord file) and made in Python, so no reader
# threads, grain's own advice for in-memory data. Its default (16 threads
# filling a 500-element buffer) contends for the GIL with the step's dispatch
# and prepares elements nothing reads: SFT's tests 58.9 -> 20.5 CPU-s.
IN_MEMORY = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class RingDataset(grain.IterDataset):
  """Trajectories read from a ``RingReader`` (the single consumer)."""

  def __init__(
      self,
      reader: ring_lib.RingReader,
      counters: StreamCounters,
      read_timeout: float | None = None,
      check_producers: Callable[[], None] | None = None,
      on_read: Callable[[Trajectory], None] | None = None,
  ):
    super().__init__()
    self._reader = reader
    self._counters = counters
    self._timeout = read_timeout
    self._check = check_producers
    self._on_read = on_read

  def __iter__(self) -> grain.DatasetIterator:
    return _RingIterator(self._reader, self._counters, self._timeout,
                         self._check, self._on_read)


class _RingIterator(grain.DatasetIterator):

  def __init__(self, reader, counters, timeout, check=None, on_read=None):
    super().__init__()
    self._reader = reader
    self._counters = counters
    self._timeout = timeout
    self._check = check
    self._on_read = on_read

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
    traj = traj_lib.decode(rec.data)
    self._counters.count_read(traj)
    if self._on_read is not None:
      self._on_read(traj)
    return traj

  def get_state(self) -> dict:
    return self._counters.as_dict()

  def set_state(self, state: dict) -> None:
    self._counters.load(state)


class StalenessFilter(grain.IterDataset):
  """Drops trajectories the staleness policy does not keep
  (docs/design/data_path.md "Staleness").

  Staleness = trainer version - the trajectory's oldest action-token version,
  with the trainer version read from ``trainer_version()`` when the record is
  consumed. Yields ``(trajectory, staleness)``; ``on_read(trajectory,
  staleness, kept)`` (the stream recorder) sees every record, dropped or not.
  A version newer than the trainer's (negative staleness) is dropped and
  counted; with ``trusted_versions`` (every version authenticated: the
  trainer's own ring and weight slot) it cannot happen, and raises.
  """

  def __init__(
      self,
      parent: grain.IterDataset,
      trainer_version: Callable[[], int],
      policy: traj_lib.StalenessPolicy,
      counters: StreamCounters,
      on_read: Callable[[Trajectory, int, bool], None] | None = None,
      trusted_versions: bool = False,
  ):
    super().__init__(parent)
    self._trusted = trusted_versions
    self._version = trainer_version
    self._policy = policy
    self._counters = counters
    self._on_read = on_read

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
      policy = self._ds._policy  # pylint: disable=protected-access
      if staleness < 0 and self._ds._trusted:  # pylint: disable=protected-access
        raise AssertionError(
            f"A trajectory of prompt {traj.prompt_id} was sampled by policy "
            f"version {version - staleness}, newer than the trainer's "
            f"{version}, from authenticated weights: a bug in publishing "
            "or version stamping, not a forgery.")
      if staleness < 0:
        c.dropped_future += 1
        logging.warning(
            "Stream dropped a trajectory sampled by policy version %d, newer "
            "than the trainer's %d (%d so far): not this run's weights.",
            version - staleness, version, c.dropped_future)
        continue
      kept = policy.keeps(staleness)
      if self._ds._on_read is not None:  # pylint: disable=protected-access
        self._ds._on_read(traj, staleness, kept)  # pylint: disable=protected-access
      if not kept:
        c.count_stale()
        if c.dropped_stale in (1, 10, 100) or c.dropped_stale % 1000 == 0:
          logging.warning(
              "Stream dropped %d stale trajectories so far (this one: "
              "staleness %d > max_staleness %d at trainer version %d).",
              c.dropped_stale, staleness, policy.max_staleness, version,
          )
        continue
      c.count_admitted(traj, staleness)
      return traj, staleness

  def get_state(self) -> dict:
    return self._parent.get_state()

  def set_state(self, state: dict) -> None:
    self._parent.set_state(state)


class TooManyErrorsError(RuntimeError):
  """Too many trajectories of a window ended in an environment error."""


class PadToLength(grain.transforms.Map):
  """(Trajectory, staleness) -> one batch row (``trajectory.pad_row``).

  An ERROR trajectory (its environment raised or timed out) becomes a row
  with no action token and no reward, so it is never trained on (batch shapes
  and groups are kept); it is counted, and more than ``max_error_frac`` of the
  last ``error_window`` trajectories being errors raises ``TooManyErrorsError``
  quoting one.
  """

  def __init__(self, seq_len: int, counters: StreamCounters, *,
               overlong: str = "drop", pad_id: int = 0,
               max_error_frac: float = 1.0, error_window: int = 64,
               trim: bool = False):
    if overlong not in ("drop", "truncate"):
      raise ValueError(
          f"overlong must be 'drop' or 'truncate', got {overlong!r}."
      )
    self._t = seq_len
    self._trim = trim  # Rows of min(length, T) tokens, unpadded (packing).
    self._counters = counters
    self._overlong = overlong
    self._pad_id = pad_id
    self._max_error_frac = float(max_error_frac)
    self._window: collections.deque[bool] = collections.deque(
        maxlen=int(error_window))

  def _check_errors(self, traj: Trajectory) -> None:
    failed = traj.finish_reason == traj_lib.FinishReason.ERROR
    self._window.append(failed)
    if not failed:
      return
    self._counters.error_rows += 1
    n = len(self._window)
    frac = sum(self._window) / n
    if n == self._window.maxlen and frac > self._max_error_frac:
      raise TooManyErrorsError(
          f"{sum(self._window)} of the last {n} trajectories ended in an "
          f"environment error (> train.max_error_frac="
          f"{self._max_error_frac:g}); e.g. prompt {traj.prompt_id} "
          f"({traj.task}): {traj.error}")

  def map(self, element):
    traj, staleness = element
    if traj.length > self._t:
      self._counters.truncated += 1
    self._check_errors(traj)
    t = min(traj.length, self._t) if self._trim else self._t
    row = traj_lib.pad_row(traj, staleness, t, self._pad_id)
    if traj.finish_reason == traj_lib.FinishReason.ERROR:
      row["action_mask"][:] = 0
      row["rewards"][:] = 0.0
    return row


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


def make_global_batch(local_batch: dict[str, np.ndarray],
                      batch_sharding: jax.sharding.NamedSharding
                      ) -> dict[str, jax.Array]:
  """Assembles each process's local rows into global ``jax.Array``s.

  Every process passes its own ``[B_local, ...]`` arrays (the rows from its
  own sampler's ring); the result is ``[B_local * num_processes, ...]``
  sharded by ``batch_sharding`` (``sharding.batch_sharding``: the batch axes
  of the mesh), via ``jax.make_array_from_process_local_data``.
  """
  return jax.tree.map(
      lambda x: jax.make_array_from_process_local_data(
          batch_sharding, np.asarray(x)), local_batch)


def to_batches(ds: grain.IterDataset, counters: StreamCounters, *,
               batch_size: int, seq_len: int, overlong: str = "drop",
               pad_id: int = 0, drop_remainder: bool = True,
               process_index: int = 0, max_error_frac: float = 1.0,
               on_batch: Callable[[dict], dict] | None = None,
               batch_sharding: Any = None, pack_segments: int = 0,
               restale: Callable[[Trajectory], int | None] | None = None,
               consumed: consumed_lib.ConsumedEpisodes | None = None
               ) -> grain.IterDataset:
  """(trajectory, staleness) elements -> ``[B, T]`` batches (the pipeline's
  tail, shared by the live stream and a replay); ``on_batch`` sees each host
  batch; with ``batch_sharding`` they become global (``make_global_batch``).

  ``pack_segments`` > 0 packs up to that many trajectories into a row
  (``packing.PackedBatches``, with ``restale`` and ``consumed``); 0 keeps one
  trajectory per row.
  """
  if overlong == "drop":
    ds = ds.filter(_OverlongFilter(seq_len, counters))
  pad = PadToLength(seq_len, counters, overlong=overlong, pad_id=pad_id,
                    max_error_frac=max_error_frac,
                    error_window=4 * batch_size, trim=pack_segments > 0)
  if pack_segments > 0:
    if restale is None:
      raise ValueError("Packing needs restale (the staleness of a held "
                       "trajectory at the next batch, or None to drop it).")
    ds = packing.PackedBatches(
        ds, batch_size=batch_size, seq_len=seq_len,
        max_segments=pack_segments, to_row=pad.map, counters=counters,
        restale=restale, consumed=consumed, pad_id=pad_id,
        drop_remainder=drop_remainder, process_index=process_index)
  else:
    ds = ds.map(pad).batch(batch_size, drop_remainder=drop_remainder).map(
        lambda batch: traj_lib.with_group_index(batch, process_index))
  ds = ds.map(counters.count_batch)
  if on_batch is not None:
    ds = ds.map(on_batch)
  if batch_sharding is not None:
    ds = ds.map(functools.partial(make_global_batch,
                                  batch_sharding=batch_sharding))
  return ds


class StreamRecorderLike(Protocol):
  """What the stream calls on its recorder (``record.StreamRecorder``)."""

  def add(self, traj: Trajectory, staleness: int, kept: bool) -> None: ...

  def batch_done(self, batch: dict) -> dict: ...


class TrajectoryStream:
  """Builds the pipeline and exposes its counters.

  Usage::

    stream = TrajectoryStream(reader, batch_size=8, seq_len=512,
                              trainer_version=lambda: state.step,
                              staleness=StalenessPolicy(max_staleness=4))
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
      staleness: traj_lib.StalenessPolicy,
      overlong: str = "drop",
      pad_id: int = 0,
      read_timeout: float | None = None,
      drop_remainder: bool = True,
      check_producers: Callable[[], None] | None = None,
      process_index: int = 0,
      max_error_frac: float = 1.0,
      recorder: StreamRecorderLike | None = None,
      trusted_versions: bool = False,
      batch_sharding: Any = None,
      consumed: consumed_lib.ConsumedEpisodes | None = None,
      pack_segments: int = 0,
  ):
    """See the module docstring for the pipeline.

    Args:
      reader: The ring's consumer.
      batch_size: Rows per batch (process-local).
      seq_len: T; shorter records are padded, longer ones see ``overlong``.
      trainer_version: Returns the trainer's current policy version.
      staleness: The staleness policy; the stream drops what it does not
        keep (docs/design/data_path.md "Staleness").
      overlong: "drop" or "truncate" (see the module docstring).
      pad_id: Token id of padding.
      read_timeout: Seconds to wait for a record before ring.RingEmptyError;
        None waits forever.
      drop_remainder: Drop a last partial batch when the ring drains.
      check_producers: Called about once a second while waiting for a record;
        raise from it to abort (e.g. when the sampler process died).
      process_index: This host's index; keeps its ``group_index`` values
        apart from other hosts' (``trajectory.with_group_index``).
      max_error_frac: Most ERROR trajectories allowed among the last
        ``4 * batch_size`` (``PadToLength``); 1 never stops.
      recorder: Sees every record read (``add``) and every batch emitted
        (``batch_done``): ``sao_jax.data.record.StreamRecorder``.
      trusted_versions: Every policy version was authenticated (the ring
        and weight slot of ``authenticate=True``): negative staleness is then
        a bug and raises instead of being dropped (``StalenessFilter``).
      batch_sharding: The mesh's batch sharding (``sharding.batch_sharding``):
        batches are then global ``jax.Array``s, ready for the train step;
        None keeps them process-local NumPy arrays.
      consumed: Told of every record read (``consumed.ConsumedEpisodes``:
        which episode numbers were consumed, for an exact resume).
      pack_segments: Pack up to this many trajectories into a row
        (``sao_jax.data.packing``; ``train.pack``); 0: one per row.
    """
    self.counters = StreamCounters()
    ds = RingDataset(reader, self.counters, read_timeout, check_producers,
                     on_read=consumed and consumed.add)
    ds = StalenessFilter(ds, trainer_version, staleness, self.counters,
                         on_read=recorder and recorder.add,
                         trusted_versions=trusted_versions)
    self.dataset: grain.IterDataset = to_batches(
        ds, self.counters, batch_size=batch_size, seq_len=seq_len,
        overlong=overlong, pad_id=pad_id, drop_remainder=drop_remainder,
        process_index=process_index, max_error_frac=max_error_frac,
        on_batch=recorder and recorder.batch_done,
        batch_sharding=batch_sharding, pack_segments=pack_segments,
        restale=functools.partial(packing.restale, trainer_version,
                                  staleness),
        consumed=consumed)
