"""Which episode starts next, and where the finished ones go.

`EpisodeFeed` is the bookkeeping every rollout engine shares, so that the
promises of the sampler do not depend on the engine: episode ``e`` gets the
task of prompt draw ``e // n_rollouts`` (a resumed run continues with the
same prompts), starts only when the `StalenessPolicy` admits the train step
it feeds, is started at most once (a resume skips those already consumed),
and its `Trajectory` is stamped with its ``group_id`` (its draw, unique
across hosts) and written the moment its group is whole (the rollouts of one
prompt go together). `Outbox` writes them to the ring.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable

from sao_jax.data.trajectory import StalenessPolicy
from sao_jax.data.trajectory import Trajectory


class Outbox:
  """Writes finished trajectories to the ring (blocking on backpressure).

  ``outbox(trajs) -> bool``: False when told to stop while waiting for
  space; the trajectories written are removed from ``trajs``. The one place a
  trajectory is encoded and handed to the ring.
  """

  def __init__(self, writer, stats, should_stop: Callable[[], bool]):
    self._writer, self._stats, self._should_stop = writer, stats, should_stop

  def __call__(self, trajs: list[Trajectory]) -> bool:
    from sao_jax.data import trajectory as codec  # pylint: disable=g-import-not-at-top
    from sao_jax.ipc import ring as ring_lib  # pylint: disable=g-import-not-at-top

    t_idle = time.perf_counter()
    self._stats.enter("waiting for ring space")
    try:
      while trajs:
        try:
          self._writer.write(*codec.encode(trajs[0]), timeout=1.0)
          del trajs[0]
        except ring_lib.RingFullError:
          if self._should_stop():
            return False
    finally:
      self._stats.idle_s += time.perf_counter() - t_idle
    return True


class EpisodeFeed:
  """Episode numbers, admission, tasks and the writing of trajectories."""

  def __init__(self, *, task_of: Callable[[int], Any],
               outbox: Callable[[list[Trajectory]], bool], stats,
               staleness: StalenessPolicy | None = None, train_batch: int = 1,
               trainer_step: Callable[[], int] = lambda: 0,
               n_rollouts: int = 1, process_index: int = 0,
               process_count: int = 1, start: int = 0,
               skip: Iterable[int] = (), limit: int | None = None):
    """Args:
      task_of: prompt draw index -> task for ``env.reset``.
      outbox: writes a list of trajectories (removing those written);
        False means stop.
      stats: a `SamplerStats` (episodes, errors, action tokens, aborted).
      staleness: admission bound (an episode starts only if the train step
        it feeds is admitted); None: every episode below ``limit``.
      train_batch: this host's trajectories per train step.
      trainer_step: () -> the trainer's current step.
      n_rollouts: rollouts per prompt draw (started and written together).
      process_index, process_count: this host (group ids unique across hosts).
      start: the first episode to start.
      skip: episodes not to start (written before a stop; whole groups).
      limit: no episode from this number on is started (None: no limit).
    """
    self.task_of, self.outbox, self.stats = task_of, outbox, stats
    self.staleness, self.train_batch = staleness, int(train_batch)
    self.trainer_step, self.n_rollouts = trainer_step, int(n_rollouts)
    self.process_index, self.process_count = process_index, process_count
    self.next_episode = int(start)
    self.skip = frozenset(skip)
    self.limit = limit
    self._groups: dict[int, list[tuple[int, Trajectory]]] = {}
    self._ready: list[Trajectory] = []

  @classmethod
  def for_tasks(cls, tasks, outbox, stats) -> "EpisodeFeed":
    """One episode per task, in order, none admitted after them."""
    return cls(task_of=lambda draw: tasks[draw], outbox=outbox, stats=stats,
               limit=len(tasks))

  def admits(self, episode: int) -> bool:
    """Whether ``episode`` may start now."""
    if self.limit is not None and episode >= self.limit:
      return False
    return self.staleness is None or self.staleness.admits(
        episode // self.train_batch, self.trainer_step())

  def admits_ahead(self, count: int) -> bool:
    """Whether the next ``count`` episodes may all start now."""
    return self.admits(self.next_episode + count - 1)

  def next_group(self) -> int | None:
    """The first episode of the next group to start (its ``n_rollouts``
    episodes are taken), or None when it is not admitted yet."""
    n = self.n_rollouts
    while self.next_episode in self.skip:
      self.next_episode += n
    if not self.admits(self.next_episode + n - 1):
      return None
    first = self.next_episode
    self.next_episode += n
    return first

  def task(self, episode: int) -> Any:
    return self.task_of(episode // self.n_rollouts)

  def finish(self, episode: int, traj: Trajectory) -> None:
    """Stamps ``traj`` (of ``episode``) and queues its group when whole."""
    draw = episode // self.n_rollouts
    traj.group_id = draw * self.process_count + self.process_index
    group = self._groups.setdefault(draw, [])
    group.append((episode, traj))
    if len(group) == self.n_rollouts:
      del self._groups[draw]
      self._ready.extend(t for _, t in sorted(group, key=lambda g: g[0]))

  def flush(self) -> bool:
    """Writes the queued trajectories; False when told to stop meanwhile."""
    if not self._ready:
      return True
    trajs = list(self._ready)
    ok = self.outbox(self._ready)  # Removes what it wrote.
    if ok:
      self._ready = []
    for traj in trajs[:len(trajs) - len(self._ready)]:
      self.stats.action_tokens += traj.num_action_tokens
      self.stats.env_errors += int(traj.error != "")
      self.stats.episodes += 1
    return ok

  def unwritten(self) -> int:
    """Finished episodes not written yet (queued, or waiting for their
    group)."""
    return len(self._ready) + sum(len(g) for g in self._groups.values())

  def abandon(self, in_flight: int) -> int:
    """Counts the episodes abandoned at a stop (``in_flight`` running plus
    the unwritten ones) in ``episodes_aborted``; returns that count."""
    count = in_flight + self.unwritten()
    self.stats.episodes_aborted += count
    return count
