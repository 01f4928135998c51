"""TensorBoard event files for scalars and histograms, written without TensorFlow.

Uses tensorboard's own ``EventFileWriter`` and ``Summary`` protos, the same records
``torch.utils.tensorboard`` writes, so ``EventAccumulator`` reads them back as
``Scalars`` and ``Histograms``.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Mapping

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
