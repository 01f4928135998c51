"""Settings that follow the task: lengths and model vocabulary at start-up.

A run's length settings and model vocabulary may be left to the task
(docs/design/envs.md "Settings that follow the task"). A key set to
``DERIVE`` (0) gets the value its task needs; an explicit value wins, but is
checked against the same measurement and a value that would cut problems is
a ``SizingError`` naming the key, the measured need and the share cut.

The measurement (``measure``): the demonstrations
(``envs.demonstrations``, the SFT warm start's very examples) of the first
``SAMPLE_SIZE`` training problems and of every held-out problem, in the
run's tokenizer and template. Per problem: its prompt, its longest action
turn (the answer, or a tool call) and the whole demonstration.

``train.sft_max_len`` is only checked when the run trains the warm start.
Derived values (``derive``), each rounded up to a multiple of
``LENGTH_MULTIPLE``:

- ``sampler.max_new_tokens``: the longest action turn plus a quarter (at
  least 2 tokens), so a reply may run a little past the longest answer;
- ``sampler.max_total_tokens`` = ``train.max_seq_len`` =
  ``train.sft_max_len``: the longest prompt plus ``PROMPT_MARGIN`` (problems
  outside the sample may be longer; a prompt that does not fit stops the
  sampler) plus the longest reply and the same margin as ``max_new_tokens``;
- ``model.vocab_size``: the tokenizer's actual size rounded up to a multiple
  of ``VOCAB_MULTIPLE`` (kernels like it; ids past the tokenizer are never
  produced by it, and the policy learns to give them no mass).

``tokenizer.vocab_size=0`` and ``tokenizer.datasets=()`` are resolved where
the tokenizer is trained (``tokenizer.tokenizer_from_config``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from absl import logging
import numpy as np

from sao_jax.envs import demonstrations
from sao_jax.envs.reasoning_gym_env import ReasoningGymTasks

DERIVE = 0
SAMPLE_SIZE = 1024
LENGTH_MULTIPLE = 8
VOCAB_MULTIPLE = 64
PROMPT_MARGIN = 0.1
# Length key -> which measured length it must hold, in words.
LENGTH_KEYS = {
    "sampler.max_new_tokens": ("action", "the longest action turn (answer "
                               "or tool call)"),
    "sampler.max_total_tokens": ("total", "prompt and reply"),
    "train.max_seq_len": ("total", "prompt and reply"),
    "train.sft_max_len": ("total", "the SFT demonstrations (prompt and "
                          "reply)"),
}


class SizingError(ValueError):
  """A setting does not fit the task (one line naming the key)."""


def round_up(n: float, multiple: int) -> int:
  return int(math.ceil(n / multiple) * multiple)


@dataclasses.dataclass(frozen=True)
class TaskLengths:
  """Token counts of a sample of the task's demonstrations (one per problem)."""

  task: str
  prompt: np.ndarray
  action: np.ndarray  # Longest trained segment (one assistant turn).
  total: np.ndarray  # Prompt, actions and observations.

  def describe(self) -> str:
    parts = [f"{what} {int(np.median(v))} median / {int(v.max())} max"
             for what, v in (("prompt", self.prompt), ("action", self.action),
                             ("demonstration", self.total))]
    return (f"{self.task!r}, {len(self.total)} sampled problems: "
            + ", ".join(parts) + " tokens")


def measure(config: Any, tokenizer: Any,
            task_sets: Sequence[ReasoningGymTasks],
            sample_size: int = SAMPLE_SIZE) -> TaskLengths:
  """Lengths of the demonstrations of the first ``sample_size`` problems of
  each task set, in ``tokenizer`` (settings of the run ``config``)."""
  settings = demonstrations.settings_from(config)
  prompt, action, total = [], [], []
  for tasks in task_sets:
    for i in range(min(sample_size, len(tasks))):
      segments = demonstrations.demonstration(
          tasks.entry(i), i, tokenizer, **settings)
      prompt.append(len(segments[0][0]))
      action.append(max(len(s) for s, trained in segments if trained))
      total.append(sum(len(s) for s, _ in segments))
  return TaskLengths(task_sets[0].name, np.asarray(prompt),
                     np.asarray(action), np.asarray(total))


def derive(lengths: TaskLengths) -> dict[str, int]:
  """The length settings ``lengths`` need (module docstring)."""
  longest_action = int(lengths.action.max())
  slack = max(2, longest_action // 4)
  new_tokens = round_up(longest_action + slack, LENGTH_MULTIPLE)
  reply = int((lengths.total - lengths.prompt).max())
  total = round_up(math.ceil(lengths.prompt.max() * (1 + PROMPT_MARGIN))
                   + reply + slack, LENGTH_MULTIPLE)
  return {"sampler.max_new_tokens": new_tokens,
          "sampler.max_total_tokens": total, "train.max_seq_len": total,
          "train.sft_max_len": total}


def check_length(key: str, value: int, lengths: TaskLengths) -> None:
  """Raises SizingError if the explicit ``value`` of ``key`` cuts problems."""
  field, what = LENGTH_KEYS[key]
  need = getattr(lengths, field)
  cut = float(np.mean(need > value))
  if cut > 0:
    raise SizingError(
        f"config.{key}={value} is too small for {lengths.task!r}: {what} "
        f"need up to {int(need.max())} tokens (median "
        f"{int(np.median(need))}); {cut:.1%} of {len(need)} sampled problems "
        f"would be cut. Raise config.{key} to >= {int(need.max())}, or set it "
        f"to {DERIVE} to derive it from the task.")


def model_vocab_size(config: Any, tokenizer: Any) -> int:
  """``model.vocab_size``, derived (``DERIVE``) or checked."""
  size, actual = int(config.model.vocab_size), int(tokenizer.vocab_size)
  if size == DERIVE:
    if config.model.init_from:
      raise SizingError(
          f"config.model.vocab_size={DERIVE} (derive) with model.init_from="
          f"{config.model.init_from!r}: set it to the checkpoint's size.")
    return round_up(actual, VOCAB_MULTIPLE)
  if size < actual:
    raise SizingError(
        f"config.model.vocab_size={size} is smaller than the tokenizer's "
        f"{actual} pieces: raise it to >= {actual}, or set it to {DERIVE} "
        f"(the tokenizer's size rounded up to a multiple of {VOCAB_MULTIPLE}).")
  return size


def _runs_sft(config: Any) -> bool:
  """Whether the run trains the SFT warm start (else sft_max_len is unused)."""
  return int(config.train.sft_steps) > 0 and not config.model.init_from


def _check_order(config: Any) -> None:
  """The orderings ``config_validation`` checks when both values are
  explicit, now that derived ones are known (same messages)."""
  s, t = config.sampler, config.train
  for key, value, floor, floor_key in (
      ("sampler.max_total_tokens", s.max_total_tokens, s.max_new_tokens,
       "sampler.max_new_tokens"),
      ("train.max_seq_len", t.max_seq_len, s.max_total_tokens,
       "sampler.max_total_tokens")):
    if value < floor:
      raise SizingError(f"config.{key}: expected int >= {floor_key}={floor}, "
                        f"got {value}")


def resolve(config: Any, tokenizer: Any,
            task_sets: Sequence[ReasoningGymTasks]) -> Any:
  """A copy of ``config`` with every derived setting filled in, checked.

  Args:
    config: The validated run config (keys at ``DERIVE`` are derived).
    tokenizer: The run's tokenizer (already trained or loaded).
    task_sets: The training tasks, then the held-out tasks.

  Returns:
    The resolved config (same lock state), which the whole run then uses.

  Raises:
    SizingError: An explicit setting is too small for the task, or one
      below a derived setting it must hold.
  """
  resolved = config.copy_and_resolve_references()
  lengths = measure(config, tokenizer, task_sets)
  derived = derive(lengths)
  chosen = {"model.vocab_size": model_vocab_size(config, tokenizer)}
  for key in LENGTH_KEYS:
    section, leaf = key.split(".")
    value = int(config[section][leaf])
    if value == DERIVE:
      value = derived[key]
    elif key != "train.sft_max_len" or _runs_sft(config):
      check_length(key, value, lengths)
    chosen[key] = value
  for key, value in chosen.items():
    section, leaf = key.split(".")
    resolved[section][leaf] = value
  _check_order(resolved)
  logging.info("Task %s (tokenizer: %d pieces).", lengths.describe(),
               int(tokenizer.vocab_size))
  for key, value in chosen.items():
    section, leaf = key.split(".")
    source = ("derived" if int(config[section][leaf]) == DERIVE
              else "explicit, fits")
    logging.info("  config.%s = %d (%s)", key, value, source)
  return resolved
