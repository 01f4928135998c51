"""TensorBoard event files for scalars and histograms, written without TensorFlow.

Uses tensorboard's own ``EventFileWriter`` and ``Summary`` protos, the same records
``torch.utils.tensorboard`` writes, so ``EventAccumulator`` reads them back as
``Scalars`` and ``Histograms``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
from typing import Any, Callable, Mapping

import numpy as np
from absl import logging
from tensorboard.compat.proto import event_pb2
from tensorboard.compat.proto import summary_pb2
from tensorboard.summary.writer import event_file_writer


def _histogram_proto(values: np.ndarray, bins: int) -> summary_pb2.HistogramProto:
  values = np.asarray(values, dtype=np.float64).reshape(-1)
  if values.size == 0:
    return summary_pb2.HistogramProto()
  counts, edges = np.histogram(values, bins=bins)
  return summary_pb2.HistogramProto(
      min=float(values.min()),
      max=float(values.max()),
      num=float(values.size),
      sum=float(values.sum()),
      sum_squares=float(np.square(values).sum()),
      bucket_limit=[float(e) for e in edges[1:]],
      bucket=[float(c) for c in counts],
  )


class MetricWriter:
  """Writes scalar and histogram summaries to ``logdir`` (one event file per run).

  ``active=False`` (the non-primary processes of a multi-host run) makes every
  write a no-op and creates no file, so a run has one event file, not one per
  host.
  """

  def __init__(self, logdir: str, *, histogram_bins: int = 30,
               active: bool = True):
    self._writer = None
    if active:
      os.makedirs(logdir, exist_ok=True)
      self._writer = event_file_writer.EventFileWriter(logdir)
    self._bins = histogram_bins
    self._closed = False
    self.logdir = logdir

  def _write(self, step: int, values: list[summary_pb2.Summary.Value]) -> None:
    if self._closed:
      raise RuntimeError(f"MetricWriter for {self.logdir} is already closed.")
    if self._writer is None:
      return
    event = event_pb2.Event(
        wall_time=time.time(), step=int(step),
        summary=summary_pb2.Summary(value=values))
    self._writer.add_event(event)

  def write_scalars(self, step: int, scalars: Mapping[str, float]) -> None:
    """Writes each finite-or-not scalar under its tag (NaN is kept: it is news)."""
    values = [
        summary_pb2.Summary.Value(tag=tag, simple_value=float(np.asarray(v)))
        for tag, v in sorted(scalars.items())
    ]
    if values:
      self._write(step, values)

  def write_histograms(self, step: int, arrays: Mapping[str, np.ndarray]) -> None:
    values = [
        summary_pb2.Summary.Value(tag=tag, histo=_histogram_proto(a, self._bins))
        for tag, a in sorted(arrays.items())
    ]
    if values:
      self._write(step, values)

  def flush(self) -> None:
    if not self._closed and self._writer is not None:
      self._writer.flush()

  def close(self) -> None:
    if not self._closed:
      self._closed = True
      if self._writer is not None:
        self._writer.close()
        logging.info("Closed TensorBoard writer for %s", self.logdir)

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """Reads every scalar series under ``logdir`` as ``{tag: [(step, value), ...]}``.

  Reads the raw records of each event file (not recursive; no reservoir
  sampling, no purging of out-of-order steps), oldest file first by the
  ``events.out.tfevents.<time>.<host>.<pid>.<uid>`` name, so when several
  files hold the same (tag, step), e.g. a resumed run, the newest write wins.
  Scalar tensor summaries count as scalars too.
  """
  from tensorboard.backend.event_processing import event_file_loader  # pylint: disable=g-import-not-at-top
  from tensorboard.util import tensor_util  # pylint: disable=g-import-not-at-top

  def age(name: str) -> tuple[int, int, str]:
    parts = name.split(".")
    wall = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0
    return wall, int(parts[-1]) if parts[-1].isdigit() else 0, name

  out: dict[str, dict[int, float]] = collections.defaultdict(dict)
  names = [n for n in os.listdir(logdir) if n.startswith("events.out.tfevents")]
  for name in sorted(names, key=age):
    loader = event_file_loader.LegacyEventFileLoader(os.path.join(logdir, name))
    for event in loader.Load():
      for value in event.summary.value:
        if value.WhichOneof("value") == "simple_value":
          out[value.tag][int(event.step)] = float(value.simple_value)
        elif value.WhichOneof("value") == "tensor":
          array = tensor_util.make_ndarray(value.tensor)
          if array.size == 1 and np.issubdtype(array.dtype, np.number):
            out[value.tag][int(event.step)] = float(array.reshape(()))
  return {tag: sorted(d.items()) for tag, d in out.items()}


def version_span(policy_version: np.ndarray,
                 action_mask: np.ndarray) -> np.ndarray:
  """Per row [B]: newest - oldest version among its action tokens (0 if
  none): how many weight swaps an episode crossed in flight."""
  acts = np.asarray(action_mask).astype(bool)
  v = np.asarray(policy_version)
  hi = np.where(acts, v, np.iinfo(np.int32).min).max(axis=1)
  lo = np.where(acts, v, np.iinfo(np.int32).max).min(axis=1)
  return np.where(acts.any(axis=1), hi - lo, 0).astype(np.float64)


def trajectory_values(batch: Mapping[str, Any], field: str,
                      to_host: Callable[[Any], np.ndarray]) -> np.ndarray:
  """One value per trajectory of this process's rows ``[N]``: a row field
  of an unpacked batch, the filled slots of a packed one (``data.packing``).
  ``to_host`` reads this process's rows (``sharding.process_rows``)."""
  values = to_host(batch[field])
  if values.ndim == 1:
    return values
  return values[to_host(batch["length"]) > 0]


def batch_version_span(batch: Mapping[str, Any],
                       to_host: Callable[[Any], np.ndarray]) -> np.ndarray:
  """``version_span`` per trajectory ``[N]`` of this process's rows; per
  packed segment when the rows are packed, never across two trajectories."""
  version = to_host(batch["policy_version"])
  acts = to_host(batch["action_mask"])
  if "segment_ids" not in batch:
    return version_span(version, acts)
  seg = to_host(batch["segment_ids"])
  filled = to_host(batch["length"]) > 0
  rows, slots = np.nonzero(filled)
  out = [version_span(version[b][None], (acts[b] * (seg[b] == s + 1))[None])
         for b, s in zip(rows, slots)]
  return np.concatenate(out) if out else np.zeros(0)


def step_scalars(step_metrics: Mapping[str, float],
                 staleness: np.ndarray,
                 *, policy_version: int, skipped_steps: int,
                 span: np.ndarray | None = None,
                 trainer_tokens_per_s: float,
                 sampler_tokens_per_s: float | None, trainer_idle_frac: float,
                 sampler_stats: Mapping[str, float] | None,
                 sampler_idle_frac: float | None, publish_s: float | None,
                 generated_tokens: int, stream_counters: Mapping[str, float],
                 ring_stats: Mapping[str, object] | None) -> dict[str, float]:
  """Every scalar a logged train step reports (the one place they are named).

  Args:
    step_metrics: The jitted step's metrics, on the host.
    staleness: The staleness of this process's rows of the step's batch.
    span: ``version_span`` of the same rows (None: left out).
    policy_version: The trainer's policy version after the step.
    skipped_steps: Non-finite steps skipped so far (``health.SkipGuard``).
    trainer_tokens_per_s: Action tokens trained per second since the last log.
    sampler_tokens_per_s: Action tokens sampled per second since the last log.
    trainer_idle_frac: Share of the run the trainer waited for batches.
    sampler_stats: ``SamplerStats.as_dict()``.
    sampler_idle_frac: ``SamplerStats.idle_frac()``.
    publish_s: Seconds spent publishing weights so far.
    generated_tokens: Action tokens read from the ring (all hosts).
    stream_counters: ``StreamCounters.as_dict()``.
    ring_stats: ``RingReader.stats()``.

  A replay (no sampler, ring or weight slot) passes None for the sampler,
  ring and publishing figures; their scalars are left out.
  """
  staleness = np.asarray(staleness, np.float64)
  scalars = {
      **{k: float(v) for k, v in step_metrics.items()},
      "staleness/min": staleness.min(),
      "staleness/mean": staleness.mean(),
      "staleness/max": staleness.max(),
      "policy_version": policy_version,
      "health/skipped_steps": float(skipped_steps),
      "throughput/trainer_tokens_per_s": trainer_tokens_per_s,
      "idle/trainer_frac": trainer_idle_frac,
      "tokens/generated_total": float(generated_tokens),
      "stream/dropped_stale": stream_counters["dropped_stale"],
      "stream/multi_version_frac": stream_counters["multi_version"] / max(
          1, stream_counters["admitted"]),
  }
  if "padding_frac" in stream_counters:  # StreamCounters.as_dict() has it.
    scalars["stream/padding_frac"] = stream_counters["padding_frac"]
  if span is not None:
    scalars["staleness/version_span"] = float(np.mean(span))
    scalars["staleness/version_span_max"] = float(np.max(span))
  if sampler_stats is not None:
    scalars.update({
        "throughput/sampler_tokens_per_s": sampler_tokens_per_s,
        "idle/sampler_frac": sampler_idle_frac,
        "weights/publish_s_total": publish_s, **sampler_stats})
    # Adopted weights pushed into the rollout engine's own copy (vLLM).
    scalars["weights/engine_push_s"] = sampler_stats.get(
        "sampler/engine_push_s", 0.0)
  if ring_stats is not None:
    scalars.update({
        "ring/occupancy_bytes": float(sum(
            lane["occupancy_bytes"] for lane in ring_stats["lanes"])),
        "ring/occupancy_frac": float(ring_stats["occupancy"]),
        "ring/producer_deaths": float(ring_stats["producer_deaths"]),
        # Records whose MAC failed or that replayed an older one: written
        # by another process, skipped (docs/design/ipc.md "Authentication").
        "ring/rejected_records": float(ring_stats["rejected_records"])})
  return scalars


def run_summary(eval_before: Mapping[str, float],
                eval_after: Mapping[str, float], steps: int,
                policy_version: int, stream_counters: Mapping[str, float],
                process_count: int, sampler_stats, clock, *,
                episodes=None,
                unread_at_stop: int | None = None) -> dict[str, float]:
  """The run's closing figures (``summary.json`` and ``summary/*`` scalars).

  ``sampler_stats`` is the sampler's ``SamplerStats`` (None in a replay: no
  sampler figures); ``clock`` the loop's wall clock (``elapsed``,
  ``trainer_wait`` and the steady-state span, from the 2nd step after the
  critic warm-up (or the resume) on: compilation excluded). ``episodes``
  (``consumed.ConsumedEpisodes``) and ``unread_at_stop`` (records left in the
  ring) account for every episode this segment started: ``sampler_episodes
  + sampler_episodes_aborted`` started = read by this segment's stream +
  ``ring_unread_at_stop`` + aborted; the unread and aborted ones are
  generated again by a resumed run.
  """
  c = stream_counters
  elapsed = clock.elapsed
  summary = {
      "accuracy_before": eval_before["eval/accuracy"],
      "accuracy_after": eval_after["eval/accuracy"],
      "eval_problems": eval_after["eval/num_problems"],
      "steps": float(steps),
      "policy_version": float(policy_version),
      "trajectories_read_from_ring": float(c["records_read"]),
      "trajectories_trained": float(c["admitted"] - c.get("pack_held", 0)),
      "padding_frac": float(c.get("padding_frac", 0.0)),
      "dropped_stale": float(c["dropped_stale"]),
      "generated_tokens": float(c["action_tokens_read"] * process_count),
      "staleness_mean": float(c["staleness_mean"]),
      "staleness_max": float(c["staleness_max"]),
      "wall_s": elapsed,
      "train_wall_s": clock.steady_s,
      "train_wall_steps": float(clock.steady_steps),
      "trainer_idle_frac": clock.trainer_wait / max(1e-9, elapsed),
  }
  if sampler_stats is not None:
    summary.update(
        sampler_episodes=float(sampler_stats.episodes),
        sampler_tokens_per_s=sampler_stats.action_tokens / max(1e-9, elapsed),
        sampler_idle_frac=sampler_stats.idle_frac(),
        sampler_decode_occupancy=sampler_stats.decode_occupancy(),
        sampler_episodes_aborted=float(sampler_stats.episodes_aborted),
        # Restarts of a dead sampler and the time without one (supervisor).
        sampler_restarts=float(getattr(sampler_stats, "restarts", 0.0)),
        sampler_downtime_s=float(getattr(sampler_stats, "downtime_s", 0.0)))
  if unread_at_stop is not None:
    summary["ring_unread_at_stop"] = float(unread_at_stop)
  if episodes is not None:
    summary.update(episodes_watermark=float(episodes.watermark),
                   episodes_above_watermark=float(len(episodes.above)),
                   episodes_consumed_twice=float(episodes.duplicates),
                   episodes_lost_in_partial_groups=float(episodes.lost))
  return summary


@dataclasses.dataclass
class RunClock:
  """Wall time, the trainer's waits and the steady state (compiles excluded)."""

  start: float = dataclasses.field(default_factory=time.perf_counter)
  trainer_wait: float = 0.0
  steady_start: float = 0.0
  steady_end: float = 0.0
  steady_steps: int = 0

  @property
  def elapsed(self) -> float:
    return time.perf_counter() - self.start

  @property
  def steady_s(self) -> float:
    """Seconds of the ``steady_steps`` steady steps (0 without one: a run,
    or a resumed run's remainder, too short for a steady state)."""
    return self.steady_end - self.steady_start if self.steady_steps else 0.0

  def step_done(self, done: int, last_compile_before: int) -> None:
    """Steps after ``last_compile_before + 1`` (the last step that compiles:
    the first one, or the first policy update after the critic warm-up) and
    one more are the steady state."""
    if done == last_compile_before + 2:  # Trainer and sampler have compiled.
      self.steady_start = time.perf_counter()
    elif self.steady_start:
      self.steady_steps += 1
      self.steady_end = time.perf_counter()


def write_json_atomic(path: str, obj: Any) -> None:
  """Writes ``obj`` as JSON to ``path`` via rename (the run-finished marker)."""
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
  os.replace(tmp, path)
