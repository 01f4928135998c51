"""Sampler restarts: a run outlives its sampler process
(docs/design/failures.md).

``SupervisedSampler`` stands where the trainer used one ``SamplerHandle``:
the same ``check`` / ``stop`` / ``set_trainer_step`` / ``stats``, plus
``reader``, the ring the trainer's stream reads. When the sampler process
dies (killed, an OOM, a bug in an environment or a tool), it

1. lets the stream read every record the dead sampler committed (its lane
   drains: the ring's producer liveness, ``ring_segment.ReaderBook``);
2. logs the death (exit code and the tail of its traceback,
   ``SamplerHandle.check``'s error);
3. starts a new sampler process, on a new ring, at the consumed-episodes
   watermark, skipping the episodes consumed above it
   (``consumed.ConsumedEpisodes.resume_plan``, as a resumed run does), with
   the newest published weights (the same weight slot);

so the episodes in flight in the dead sampler are generated again and none is
consumed twice (``episodes_consumed_twice`` in the summary stays 0).
``RestartPolicy`` bounds it (``sampler.max_restarts`` per trainer process,
``sampler.max_restarts_per_window`` within ``sampler.restart_window_s``);
past it the run stops with the dead sampler's ``SamplerDiedError``.
``stats`` merges the counters of all the run's samplers (each as declared:
summed, the largest or the newest sampler's; ``sampler/stats.py``) and adds
``restarts`` and ``downtime_s`` (from noticing a death to the new sampler's
first record): ``sampler/restarts``, ``sampler/downtime_s``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from absl import logging

from sao_jax.data import consumed as consumed_lib
from sao_jax.ipc import ring as ring_lib
from sao_jax.sampler import process as process_lib
from sao_jax.sampler import stats as stats_lib


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
  """How many sampler restarts a run allows (0: the first death ends it)."""

  max_restarts: int = 0  # Per trainer process.
  window_s: float = 600.0
  max_per_window: int = 0  # Within any window_s; 0: no window bound.

  @classmethod
  def from_config(cls, config: Any) -> RestartPolicy:
    s = config.sampler
    return cls(int(s.max_restarts), float(s.restart_window_s),
               int(s.max_restarts_per_window))

  def refusal(self, times: list[float], now: float) -> str:
    """Why one more restart (at ``now``, after those at ``times``) is not
    allowed; '' when it is."""
    if len(times) >= self.max_restarts:
      return (f"No restart left: {len(times)} of sampler.max_restarts="
              f"{self.max_restarts} used.")
    recent = sum(now - t < self.window_s for t in times)
    if self.max_per_window and recent >= self.max_per_window:
      return (f"No restart left: {recent} in the last {self.window_s:g} s "
              f"(sampler.max_restarts_per_window={self.max_per_window}, "
              "sampler.restart_window_s): it keeps dying; see its error.")
    return ""


class RunSamplerStats(process_lib.SamplerStats):
  """``SamplerStats`` of a run's samplers together (a private snapshot)."""

  restarts = 0.0
  downtime_s = 0.0

  def as_dict(self) -> dict[str, float]:
    return {**super().as_dict(), "sampler/restarts": float(self.restarts),
            "sampler/downtime_s": float(self.downtime_s)}


# The counters of a run's replaced samplers, merged: name -> (merge, value).
Retired = dict[str, tuple[str, float]]


def retire(past: Retired, stats: stats_lib.SamplerStats,
           **overrides: float) -> None:
  """Merges a replaced sampler's counters (`overrides` by name) into `past`."""
  for name, merge, value in stats.counters():
    value = overrides.get(name, value)
    before = past[name][1] if name in past else None
    past[name] = merge, stats_lib.merged(merge, before, value)


def run_counters(past: Retired, now: stats_lib.SamplerStats
                 ) -> RunSamplerStats:
  """The run's counters: `past` merged with the current sampler's, `now`;
  the ``LAST`` of a counter `now` has not set yet is left out."""
  out = RunSamplerStats()
  for name, (merge, value) in past.items():
    if merge != stats_lib.LAST:
      out.put(name, merge, value)
  for name, merge, value in now.counters():
    before = past[name][1] if name in past else None
    out.put(name, merge, stats_lib.merged(merge, before, value))
  return out


class _Reader:
  """The ring the stream reads: the current sampler's (a restart swaps it)."""

  def __init__(self, owner: SupervisedSampler):
    self._owner = owner

  @property
  def name(self) -> str:
    return self._owner.ring.name

  def read(self, timeout: float | None = None) -> ring_lib.Record:
    """``RingReader.read`` of the current ring; when a dead sampler's ring
    has drained, restarts it (or raises its ``SamplerDiedError``) and reads
    on from the new ring."""
    while True:
      try:
        record = self._owner.ring.read(timeout=timeout)
      except ring_lib.RingDrained:
        if self._owner.stopping():
          raise
      else:
        self._owner.record_arrived()
        return record
      self._owner.restart()  # Outside the handler: no chained error.

  def stats(self) -> dict:
    return self._owner.ring.stats()

  def close(self) -> None:
    self._owner.ring.close()


class SupervisedSampler:
  """One sampler process at a time, restarted when it dies (module doc).

  Args:
    spec: The first sampler's spec (``ring_name``, ``ring_key``,
      ``start_episode`` and ``skip_episodes`` are replaced at each restart).
    ring: The ring ``spec`` names; ``make_ring()`` makes each new one.
    consumed: This host's consumed episodes (the stream adds what it reads).
    policy: The restart bounds.
  """

  def __init__(self, spec: process_lib.SamplerSpec, ring: ring_lib.RingReader,
               make_ring: Callable[[], ring_lib.RingReader],
               consumed: consumed_lib.ConsumedEpisodes, policy: RestartPolicy):
    self.spec, self.ring, self._make_ring = spec, ring, make_ring
    self._consumed, self.policy = consumed, policy
    self.handle = process_lib.SamplerHandle(spec)
    self.reader = _Reader(self)
    self._step = 0
    self._stopping = False
    self._past: Retired = {}
    self._restart_times: list[float] = []
    self._down_since: float | None = None
    self.downtime_s = 0.0
    self._died: process_lib.SamplerDiedError | None = None

  @property
  def restarts(self) -> int:
    return len(self._restart_times)

  @property
  def stats(self) -> RunSamplerStats:
    """The counters of every sampler of this run, each merged as it was
    declared (``stats.SUM``, ``MAX``, ``LAST``; a snapshot)."""
    out = run_counters(self._past, self.handle.stats)
    out.restarts, out.downtime_s = float(self.restarts), self.downtime()
    return out

  def downtime(self) -> float:
    """Seconds without a sampler: noticed deaths to the next first record."""
    if self._down_since is None:
      return self.downtime_s
    return self.downtime_s + time.monotonic() - self._down_since

  def start(self) -> None:
    self.handle.set_trainer_step(self._step)
    self.handle.start()

  def set_trainer_step(self, step: int) -> None:
    self._step = int(step)
    self.handle.set_trainer_step(step)

  def alive(self) -> bool:
    return self.handle.alive()

  def check(self, wait_s: float = 0.0) -> None:
    """The stream's producer check (about once a second while it waits).

    A sampler that died before claiming its ring lane wrote nothing: it is
    restarted here. One that claimed it is restarted once its lane drains
    (``_Reader.read``), so its committed records are read first. Without a
    restart left, the stream ends and the next call raises the dead
    sampler's ``SamplerDiedError``.
    """
    if self._died is not None:  # Past the bounds: the run stops with it.
      raise self._died
    if wait_s > 0:
      self.handle.process.join(wait_s)
    if self.stopping() or self.handle.alive():
      return
    if self.ring.stats()["lanes"][0]["state"] == "free":
      self.restart()

  def stopping(self) -> bool:
    """Whether the sampler was asked to stop (its ring's drain is expected)."""
    return self._stopping or self.handle.stop_event.is_set()

  def record_arrived(self) -> None:
    if self._down_since is not None:
      self.downtime_s += time.monotonic() - self._down_since
      self._down_since = None

  def _death(self) -> process_lib.SamplerDiedError:
    """The dead sampler's error (exit code, traceback tail), once it exits."""
    try:
      self.handle.check(wait_s=10.0)
    except process_lib.SamplerDiedError as e:
      return e
    # Its lane is closed but it has not exited: end it.
    self.handle.stop(timeout=5.0)
    return process_lib.SamplerDiedError(
        f"Sampler process {self.handle.process.pid} closed its ring lane "
        "without being asked and did not exit; it was stopped.")

  def restart(self) -> None:
    """The sampler is gone (its ring drained, no stop): logs the death and
    starts a new one, or raises its error past the bounds (module doc)."""
    died = self._death()
    now = time.monotonic()
    refusal = self.policy.refusal(self._restart_times, now)
    if refusal:
      if self.restarts:
        died.args = (f"After {self.restarts} sampler restarts ({refusal}) "
                     f"{died.args[0]}",)
      # The stream ends (the drained ring's StopIteration) and the loop's
      # next `check` raises the error, outside the input pipeline.
      self._died = died
      raise ring_lib.RingDrained(f"Ring {self.ring.name}: its sampler died "
                                 "and is not restarted.")
    self._restart_times.append(now)
    if self._down_since is None:
      self._down_since = now
    old_stats, old_ring = self.handle.stats, self.ring
    written = old_ring.stats()["lanes"][0]["records_written"]
    # Its episodes are counted at commit, not after a SIGKILL.
    retire(self._past, old_stats, episodes=written)
    start_episode, skip = self._consumed.resume_plan()
    logging.warning(
        "%s\nRestarting the sampler (restart %d of at most %d): at episode "
        "%d, skipping %d consumed above it, newest published weights; the "
        "episodes it had in flight are generated again.", died,
        self.restarts, self.policy.max_restarts, start_episode, len(skip))
    new_ring = self._make_ring()
    old_ring.close()
    self.ring = new_ring
    self.spec = dataclasses.replace(
        self.spec, ring_name=self.ring.name, ring_key=self.ring.key,
        start_episode=start_episode, skip_episodes=tuple(sorted(skip)))
    self.handle = process_lib.SamplerHandle(self.spec)
    self.start()

  def stop(self, timeout: float = 30.0) -> None:
    self._stopping = True
    self.handle.stop(timeout)
