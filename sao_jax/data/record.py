"""Record and replay of the trainer's trajectory stream
(docs/design/data_path.md "Record and replay").

Recording (``train.record_stream``): every trajectory the stream reads from
the ring, in consumption order, is written with the train step whose batch
read it, its staleness at consumption and whether the staleness filter kept
it, to ``<workdir>/stream/`` as ArrayRecord shards named by the steps they
hold::

    p000-00000000-00000010.array_record   process 0, steps [0, 10)
    p000-00000010-open.array_record       being written (not yet closed)

A shard is closed every ``train.record_shard_steps`` steps, at every
checkpoint step and when the run stops, so everything a checkpoint covers is
in closed shards. A resumed run first cuts the stream back to the step it
resumed from (``truncate``), then appends: the stream stays complete and
holds each step once across stop/resume.

Replay (``ReplayStream``): the recorded entries of steps ``[start, stop)``
through a grain pipeline (``ArrayRecordDataSource`` -> ``MapDataset``) into
the same batches the original trainer consumed: stale-dropped entries are
counted and skipped, the rest keep their recorded staleness.

Entry layout: ``<qiB3x`` header (step, staleness, kept) + ``trajectory.encode`` bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
from typing import Any, Mapping

from absl import logging
from array_record.python import array_record_module
import grain

from sao_jax.data import stream as stream_lib
from sao_jax.data import trajectory as traj_lib
from sao_jax.data.trajectory import Trajectory

_HEADER = struct.Struct("<qiB3x")
_SHARD = re.compile(r"^p(\d{3})-(\d{8})-(\d{8}|open)\.array_record$")
_WRITER_OPTIONS = "group_size:1"  # Entry-level random access for grain.
CONFIG_FILE = "config.json"


class RecordError(RuntimeError):
  """A recorded stream is missing, incomplete or does not fit the replay."""


@dataclasses.dataclass
class Entry:
  """One recorded trajectory and what the trainer did with it."""

  step: int  # The train step whose batch read it.
  staleness: int  # Trainer version at consumption - oldest token version.
  kept: bool  # False: dropped as stale.
  traj: Trajectory


def encode_entry(entry: Entry) -> bytes:
  header = _HEADER.pack(entry.step, entry.staleness, int(entry.kept))
  return header + b"".join(bytes(b) for b in traj_lib.encode(entry.traj))


def decode_entry(raw: bytes) -> Entry:
  step, staleness, kept = _HEADER.unpack_from(raw, 0)
  traj = traj_lib.decode(bytearray(raw[_HEADER.size:]))
  return Entry(int(step), int(staleness), bool(kept), traj)


def shard_name(process_index: int, start: int, end: int | None) -> str:
  stop = "open" if end is None else f"{end:08d}"
  return f"p{process_index:03d}-{start:08d}-{stop}.array_record"


def list_shards(directory: str, process_index: int = 0, *,
                include_open: bool = False
                ) -> list[tuple[int, int | None, str]]:
  """``(start, end, path)`` of this process's shards, by start step.

  ``end`` is None for an open shard (only with ``include_open``).
  """
  out = []
  if os.path.isdir(directory):
    for name in os.listdir(directory):
      m = _SHARD.match(name)
      if not m or int(m.group(1)) != process_index:
        continue
      end = None if m.group(3) == "open" else int(m.group(3))
      if end is not None or include_open:
        out.append((int(m.group(2)), end, os.path.join(directory, name)))
  return sorted(out, key=lambda s: (s[0], s[1] is None))


def read_shard(path: str) -> list[Entry]:
  """Every entry of one closed shard, in order."""
  reader = array_record_module.ArrayRecordReader(path)
  try:
    return [decode_entry(r) for r in reader.read_all()]
  finally:
    reader.close()


def _write_shard(path: str, entries: list[Entry]) -> None:
  writer = array_record_module.ArrayRecordWriter(path, _WRITER_OPTIONS)
  for e in entries:
    writer.write(encode_entry(e))
  writer.close()


def recorded_range(directory: str, process_index: int = 0) -> tuple[int, int]:
  """``[first, end)`` steps the closed shards hold; raises on a gap."""
  shards = list_shards(directory, process_index)
  if not shards:
    raise RecordError(
        f"No recorded stream for process {process_index} in {directory}; "
        "record one with --config.train.record_stream=True.")
  for (_, end, path), (start, _, _) in zip(shards, shards[1:]):
    if start != end:
      raise RecordError(
          f"The recorded stream in {directory} misses steps [{end}, {start}) "
          f"(after {os.path.basename(path)}): it cannot be replayed across "
          "them; replay a window after the gap.")
  return shards[0][0], shards[-1][1]


def truncate(directory: str, step: int, process_index: int = 0) -> None:
  """Cuts the stream back to steps ``< step`` (a resume from ``step``).

  Open shards (written after the last checkpoint) are deleted, shards from
  ``step`` on deleted, and a shard straddling ``step`` rewritten to end there.
  """
  for start, end, path in list_shards(directory, process_index,
                                      include_open=True):
    if end is not None and end <= step:
      continue
    if end is None or start >= step:
      os.remove(path)
      continue
    kept = [e for e in read_shard(path) if e.step < step]
    tmp = os.path.join(directory, shard_name(process_index, start, None))
    _write_shard(tmp, kept)
    os.replace(tmp, os.path.join(directory,
                                 shard_name(process_index, start, step)))
    os.remove(path)
  if list_shards(directory, process_index):
    _, end = recorded_range(directory, process_index)
    if end < step:
      logging.warning(
          "The recorded stream in %s ends at step %d but the run resumes at "
          "step %d: steps [%d, %d) were not recorded and cannot be replayed.",
          directory, end, step, end, step)


class StreamRecorder:
  """Writes the stream's entries; the ``TrajectoryStream`` hooks call it.

  ``add`` is called for every trajectory read (kept or dropped as stale);
  ``batch_done`` once per emitted batch, which ends the current step.
  """

  def __init__(self, directory: str, *, start_step: int, shard_steps: int,
               checkpoint_every: int = 0, process_index: int = 0,
               config: Any = None):
    os.makedirs(directory, exist_ok=True)
    truncate(directory, start_step, process_index)
    self.directory = directory
    self.step = int(start_step)
    self._cuts = tuple(n for n in (int(shard_steps), int(checkpoint_every))
                       if n > 0)
    self._process = int(process_index)
    self._start = self.step
    self._writer = None
    if config is not None and process_index == 0:
      with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        f.write(config.to_json_best_effort(indent=1, sort_keys=True))

  def _open_path(self) -> str:
    return os.path.join(self.directory,
                        shard_name(self._process, self._start, None))

  def add(self, traj: Trajectory, staleness: int, kept: bool) -> None:
    if self._writer is None:
      self._start = self.step
      self._writer = array_record_module.ArrayRecordWriter(
          self._open_path(), _WRITER_OPTIONS)
    self._writer.write(encode_entry(Entry(self.step, staleness, kept, traj)))

  def batch_done(self, batch: Any) -> Any:
    """Ends the step whose batch this is; cuts a shard on a boundary."""
    self.step += 1
    if any(self.step % n == 0 for n in self._cuts):
      self.close()
    return batch

  def close(self) -> None:
    """Closes the open shard under its final name (steps it holds)."""
    if self._writer is None:
      return
    self._writer.close()
    self._writer = None
    os.replace(self._open_path(), os.path.join(
        self.directory, shard_name(self._process, self._start, self.step)))


def recorded_config(directory: str) -> dict[str, Any] | None:
  """The recorded run's config (as JSON), if it was saved."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def differing_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
  """Dotted keys (``rl.loss``) whose values differ between two nested dicts
  (configs as ``to_dict()`` or JSON), sorted; a key missing on one side
  differs."""

  def flat(d, prefix=""):
    for k, v in d.items():
      if isinstance(v, Mapping):
        yield from flat(v, f"{prefix}{k}.")
      else:
        yield f"{prefix}{k}", v

  fa, fb = dict(flat(a)), dict(flat(b))
  return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def config_differences(directory: str, config: Any) -> list[str]:
  """Dotted keys whose values differ from the recorded run's config."""
  recorded = recorded_config(directory)
  if recorded is None:
    return []
  return differing_keys(recorded, json.loads(config.to_json_best_effort()))


class _Admitted(grain.transforms.Filter):
  """Counts each entry as the live stream did; keeps the unstale ones.

  The k-th kept entry must belong to step ``start + k // batch_size``;
  anything else means the recording and this replay are out of step.
  """

  def __init__(self, counters: stream_lib.StreamCounters, start: int,
               batch_size: int):
    self._counters, self._start, self._b = counters, start, batch_size
    self._kept = 0

  def filter(self, entry: Entry) -> bool:
    self._counters.count_read(entry.traj)
    if not entry.kept:
      self._counters.count_stale()
      return False
    expected = self._start + self._kept // self._b
    if entry.step != expected:
      raise RecordError(
          f"Recorded entry of step {entry.step} arrived as part of step "
          f"{expected}'s batch: the stream was recorded with another batch "
          "size or is corrupted; replay with the recorded train.batch_size.")
    self._kept += 1
    self._counters.count_admitted(entry.traj, entry.staleness)
    return True


class ReplayStream:
  """The recorded batches of steps ``[start, stop)`` (a ``TrajectoryStream``
  stand-in: ``dataset`` yields the same ``[B, T]`` batches, ``counters``
  count as the live stream did)."""

  def __init__(self, directory: str, *, start: int, stop: int,
               batch_size: int, seq_len: int, overlong: str, pad_id: int,
               process_index: int = 0, batch_sharding: Any = None):
    if overlong != "truncate":
      raise ValueError(
          f"Replay needs overlong='truncate' (as the live loop), got "
          f"{overlong!r}: dropping rows would shift the recorded steps.")
    first, end = recorded_range(directory, process_index)
    if not first <= start <= stop <= end:
      raise RecordError(
          f"Cannot replay steps [{start}, {stop}): the stream in {directory} "
          f"holds steps [{first}, {end}). Pick train.replay_steps inside it.")
    paths = [p for s, e, p in list_shards(directory, process_index)
             if e > start and s < stop]
    self.counters = stream_lib.StreamCounters()
    source = grain.sources.ArrayRecordDataSource(paths)
    ds = (grain.MapDataset.source(source).map(decode_entry)
          .filter(lambda e: start <= e.step < stop)
          .to_iter_dataset(stream_lib.IN_MEMORY))
    ds = ds.filter(_Admitted(self.counters, start, batch_size)).map(
        lambda e: (e.traj, e.staleness))
    self.dataset = stream_lib.to_batches(
        ds, self.counters, batch_size=batch_size, seq_len=seq_len,
        overlong=overlong, pad_id=pad_id, process_index=process_index,
        batch_sharding=batch_sharding)
