"""The prompt side: a shuffled, repeated grain ``MapDataset`` of tasks.

The sampler draws tasks from ``iter(prompt_dataset(...))``; the iterator's
``get_state()``/``set_state()`` checkpoint where it is, so a restarted sampler
continues with the same next prompt.
"""

from __future__ import annotations

from typing import Any, Sequence

import grain


def prompt_dataset(
    tasks: Sequence[Any],
    *,
    seed: int,
    shuffle: bool = True,
    num_epochs: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
) -> grain.MapDataset:
  """Tasks, sharded per host, shuffled each epoch with ``seed``, repeated.

  Args:
    tasks: Any random-access sequence of task records.
    seed: Shuffle seed (the order differs per epoch but is reproducible).
    shuffle: Whether to shuffle.
    num_epochs: Passes over the data; None repeats forever.
    shard_index: This host's shard (e.g. ``jax.process_index()``).
    shard_count: Number of shards (e.g. ``jax.process_count()``).
  """
  if len(tasks) == 0:
    raise ValueError("prompt_dataset() got no tasks; check the task source.")
  if not 0 <= shard_index < shard_count:
    raise ValueError(
        f"shard_index {shard_index} not in [0, shard_count={shard_count})."
    )
  ds = grain.MapDataset.source(tasks)
  if shard_count > 1:
    ds = ds[shard_index::shard_count]
  if shuffle:
    ds = ds.shuffle(seed=seed)
  return ds.repeat(num_epochs)


def prompt_iterator(tasks: Sequence[Any], **kwargs) -> grain.DatasetIterator:
  """A checkpointable iterator over ``prompt_dataset(tasks, **kwargs)``."""
  return iter(prompt_dataset(tasks, **kwargs).to_iter_dataset())
