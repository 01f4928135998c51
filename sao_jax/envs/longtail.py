"""A long-tail workload: the tool-use task with answer lengths varying 16x.

Agentic episodes have a long tail of lengths (one answer takes 8 tokens,
another 128). `LongTailToolEnv` makes that tail a property of the task, so
that it holds even for a policy that never stops early (the random-init
policy of the benchmark, experiments/bench/async_vs_sync.py): task ``t``
allows actions of at most ``min_tokens * 2**j`` tokens, ``j`` drawn from a
geometric distribution (``P(j) = 2**-(j+1)``, the last level taking the
rest) by a hash of ``t``, so a task always gets the same budget. The sampler
reads it through `Environment.action_budget`. Scoring is the tool-use task's.
"""

from __future__ import annotations

import hashlib

from sao_jax.envs.tool_env import ToolEnv


def length_level(task: int, levels: int) -> int:
  """Geometric level of ``task`` in [0, levels): half at 0, a quarter at 1..."""
  digest = hashlib.blake2b(str(int(task)).encode(), digest_size=8).digest()
  bits = int.from_bytes(digest, "little") | (1 << (levels - 1))
  return min((bits & -bits).bit_length() - 1, levels - 1)


class LongTailToolEnv(ToolEnv):
  """`ToolEnv` whose task ``t`` caps actions at ``min_tokens * 2**level(t)``."""

  name_suffix = "+calc+longtail"

  def __init__(self, *args, min_tokens: int = 8, levels: int = 5, **kwargs):
    super().__init__(*args, **kwargs)
    if min_tokens < 1 or levels < 1:
      raise ValueError(f"min_tokens={min_tokens} and levels={levels} must be "
                       ">= 1 (env.longtail_min_tokens, env.longtail_levels).")
    self.min_tokens, self.levels = int(min_tokens), int(levels)
    self._budget: int | None = None

  def reset(self, task: int) -> str:
    self._budget = self.min_tokens << length_level(task, self.levels)
    return super().reset(task)

  def action_budget(self) -> int | None:
    return self._budget
