"""The prompt side: a shuffled, repeated grain ``MapDataset`` of tasks.

The sampler draws tasks from ``iter(prompt_dataset(...))``; the iterator's
``get_state()``/``set_state()`` checkpoint where it is, so a restarted sampler
continues with the same next prompt. ``FittingPrompts`` skips the tasks whose
prompt alone exceeds the token budget, before any episode starts.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from absl import logging
import grain

from sao_jax.data import stream


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
  return iter(prompt_dataset(tasks, **kwargs).to_iter_dataset(
      stream.IN_MEMORY))


class FittingPrompts:
  """Prompt draw ``k`` -> a task whose prompt fits the token budget.

  Draw ``k`` is ``ds[k]`` unless that task's prompt has ``max_tokens`` tokens
  or more; it is then skipped (counted in ``skipped``, with a warning) for
  ``ds[k + n]``, ``ds[k + 2n]``, ... (the same draw in later epochs, ``n``
  tasks per epoch). The task of a draw depends on ``k`` alone, so a resumed
  sampler picks the same tasks; each task's length is computed once.
  """

  def __init__(self, ds: grain.MapDataset, epoch_len: int,
               prompt_len: Callable[[Any], int], max_tokens: int,
               max_tries: int = 64):
    """Args:
      ds: The prompt dataset (``prompt_dataset``).
      epoch_len: Tasks per epoch of ``ds``.
      prompt_len: A task's prompt length in tokens; an exception counts as
        fitting (the episode's own ``reset`` then reports it).
      max_tokens: Prompts of this many tokens or more are skipped.
      max_tries: Draws of one ``k`` before giving up with an error.
    """
    self._ds, self._epoch = ds, int(epoch_len)
    self._len, self._max = prompt_len, int(max_tokens)
    self._tries = int(max_tries)
    self._lengths: dict[Any, int] = {}
    self.skipped = 0

  def _length(self, task: Any) -> int:
    if task not in self._lengths:
      try:
        self._lengths[task] = int(self._len(task))
      except Exception:  # pylint: disable=broad-except
        self._lengths[task] = 0
    return self._lengths[task]

  def __getitem__(self, k: int) -> Any:
    for t in range(self._tries):
      task = self._ds[k + t * self._epoch]
      n = self._length(task)
      if n < self._max:
        return task
      self.skipped += 1
      if math.log10(self.skipped).is_integer():  # 1st, 10th, 100th...
        logging.warning(
            "Skipped the prompt of task %s: %d tokens >= max_total_tokens=%d "
            "(%d prompts skipped so far).", task, n, self._max, self.skipped)
    raise ValueError(
        f"Prompt draw {k}: {self._tries} tasks in a row have prompts too "
        f"long (e.g. task {task}: {n} tokens >= max_total_tokens="
        f"{self._max}); raise sampler.max_total_tokens or choose shorter "
        "tasks.")
