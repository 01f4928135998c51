"""Which episode numbers the trainer has consumed, for an exact resume.

The sampler numbers its episodes per host (``EpisodeFeed``: episode ``e`` is
prompt draw ``e // n_rollouts``; a trajectory's ``group_id`` is ``draw *
process_count + process_index``). In ``async`` mode episodes reach the ring
out of order, so a count of the records read does not say which ones were
read. `ConsumedEpisodes` keeps, per host, the contiguous watermark ``W``
(every episode below it consumed) and the few consumed above it (bounded by
the slots and the staleness bound). "Consumed" is read from the ring by the
trainer's stream: trained on, or dropped (stale, over-long) and counted
there. A checkpoint saves every host's (``to_meta``); a resumed sampler starts
at ``W`` and skips the ones above it (docs/design/sampler.md "Exactly once
across stop and resume"), so episodes that were in flight or left unread in the
ring at the stop are generated again and none is consumed twice. Episodes read
but held for a later batch (sequence packing, ``hold`` / ``release``) are left
out of ``to_meta`` until released: a resume generates them again.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from absl import logging
import jax
import numpy as np

from sao_jax.data.trajectory import Trajectory

META_KEY = "episodes"  # Checkpoint meta: one entry per host.


class ConsumedEpisodes:
  """One host's consumed episode numbers: watermark + the set above it."""

  def __init__(self, watermark: int = 0, above: Sequence[int] = (), *,
               n_rollouts: int = 1, process_count: int = 1):
    self.n_rollouts, self.process_count = int(n_rollouts), int(process_count)
    self.watermark = int(watermark)
    self.above: set[int] = set()
    self.duplicates = 0  # Episodes read again (a resume bug; logged).
    self.lost = 0  # Rollouts of partly read groups skipped at a resume.
    self.held: set[int] = set()  # Read, not yet in an emitted batch.
    # Rollouts of each draw read so far: a group's are written together, in
    # episode order, so the k-th one read is episode draw * n_rollouts + k.
    self._read_of_draw: collections.Counter[int] = collections.Counter()
    for e in above:
      self._add(int(e))

  @property
  def count(self) -> int:
    return self.watermark + len(self.above)

  def __contains__(self, episode: int) -> bool:
    return episode < self.watermark or episode in self.above

  def episode_of(self, group_id: int) -> int:
    """The episode number of the next record read with ``group_id``."""
    draw = int(group_id) // self.process_count
    k = self._read_of_draw[draw]
    self._read_of_draw[draw] = (k + 1) % self.n_rollouts
    if not self._read_of_draw[draw]:
      del self._read_of_draw[draw]
    return draw * self.n_rollouts + k

  def add(self, traj: Trajectory) -> None:
    """Counts a record the stream read (the stream's ``on_read`` hook)."""
    if traj.group_id < 0:
      raise ValueError(
          f"A trajectory of prompt {traj.prompt_id} has no group_id: only "
          "the sampler's trajectories (stamped with their prompt draw) can "
          "be tracked.")
    traj.episode = self.episode_of(traj.group_id)
    self._add(traj.episode)

  def hold(self, episode: int) -> None:
    """``episode`` was read but waits for a later batch (packing): not
    consumed in ``to_meta`` until ``release``; -1 (untracked) is ignored."""
    if episode >= 0:
      self.held.add(int(episode))

  def release(self, episode: int) -> None:
    """``episode`` left the hold (trained, or dropped and counted)."""
    self.held.discard(int(episode))

  def _add(self, episode: int) -> None:
    if episode in self:
      self.duplicates += 1
      logging.warning("Episode %d was consumed twice (%d so far).", episode,
                      self.duplicates)
      return
    self.above.add(episode)
    while self.watermark in self.above:
      self.above.remove(self.watermark)
      self.watermark += 1

  def to_meta(self) -> dict[str, Any]:
    """Watermark and the episodes above it; held ones count as unread."""
    if not self.held:
      return {"watermark": self.watermark, "above": sorted(self.above)}
    low = min(min(self.held), self.watermark)
    above = (set(range(low, self.watermark)) | self.above) - self.held
    return {"watermark": low, "above": sorted(above)}

  def resume_plan(self) -> tuple[int, frozenset[int]]:
    """``(start_episode, skip)`` for the resumed sampler.

    With ``n_rollouts > 1`` the sampler starts or skips whole groups: a group
    read only partly at the stop (a batch ended inside it) is skipped and its
    unread rollouts are counted consumed (never trained on) and in ``lost``.
    """
    n = self.n_rollouts
    partial = {e // n for e in self.above} | (
        {self.watermark // n} if self.watermark % n else set())
    lost = [e for d in sorted(partial) for e in range(d * n, d * n + n)
            if e not in self]
    for e in lost:
      self._add(e)
    self.lost += len(lost)
    if lost:
      logging.warning(
          "Resume: %d rollouts of groups read only partly before the stop "
          "are skipped (their groups' other rollouts were consumed).",
          len(lost))
    return self.watermark, frozenset(self.above)


def from_meta(meta: dict[str, Any], n_rollouts: int,
              process_index: int | None = None,
              process_count: int | None = None) -> ConsumedEpisodes:
  """This host's tracker from a checkpoint's meta (empty for a fresh run);
  the process index and count default to JAX's.

  A checkpoint written before the tracker existed holds only the count
  ``episodes_consumed``: the watermark is then this host's share of it (as
  that run's sampler resumed) and nothing above it.
  """
  if process_index is None or process_count is None:
    process_index, process_count = jax.process_index(), jax.process_count()
  hosts = meta.get(META_KEY)
  if not hosts:
    return ConsumedEpisodes(
        int(meta.get("episodes_consumed", 0)) // process_count,
        n_rollouts=n_rollouts, process_count=process_count)
  if len(hosts) != process_count:
    raise ValueError(
        f"The checkpoint's meta holds consumed episodes of {len(hosts)} hosts "
        f"but the run has {process_count}: resume with the same number of "
        "processes.")
  own = hosts[process_index]
  return ConsumedEpisodes(own["watermark"], own["above"],
                          n_rollouts=n_rollouts, process_count=process_count)


def meta(tracker: ConsumedEpisodes, collective: bool) -> dict[str, Any]:
  """``{META_KEY: all_hosts(tracker)}`` for ``run.meta``. Multi-host that is a
  collective, done only where all hosts save (``collective``); {} else."""
  if collective or tracker.process_count == 1:
    return {META_KEY: all_hosts(tracker)}
  return {}


def all_hosts(tracker: ConsumedEpisodes) -> list[dict[str, Any]]:
  """Every host's ``to_meta()``, in process order (collective when multi-host:
  every process must call it)."""
  mine = tracker.to_meta()
  if tracker.process_count == 1:
    return [mine]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  own = np.asarray([mine["watermark"], *mine["above"]], np.int64)
  longest = int(np.max(multihost_utils.process_allgather(
      np.int64(own.size))))
  padded = np.full(longest, -1, np.int64)
  padded[:own.size] = own
  rows = np.asarray(multihost_utils.process_allgather(padded))
  return [{"watermark": int(r[0]), "above": [int(e) for e in r[1:] if e >= 0]}
          for r in rows]
