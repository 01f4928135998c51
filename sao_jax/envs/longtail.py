"""A long-tail workload: the tool-use task with episode lengths varying 16x.

Agentic episodes have a long tail of lengths (one answer takes 8 tokens,
another 128; one episode makes no tool call, another four). `LongTailToolEnv`
makes that tail a property of the task, so that it holds even for a policy
that never stops early (the random-init policy of the benchmark,
experiments/bench/async_vs_sync.py):

- task ``t`` allows actions of at most ``min_tokens * 2**j`` tokens, ``j``
  drawn from a geometric distribution (``P(j) = 2**-(j+1)``, the last level
  taking the rest) by a hash of ``t``, so a task always gets the same
  budget. The sampler reads it through `Environment.action_budget`.
- with ``tool_calls > 0``, the task's first ``k`` actions are tool calls,
  ``k`` geometric in ``[0, tool_calls]`` (another hash of ``t``), each
  answered after ``tool_latency_s`` (a sandbox's round trip; the call sleeps
  on the sampler's env thread, not on its decode loop), and actions are
  complete at their length (`fixed_length_actions`, as a benchmark's
  ``ignore_eos`` request). The action after the calls is the answer.

A systems workload, not a task to learn: scoring is the tool-use task's, but
the forced calls ignore what the action says beyond evaluating it.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from sao_jax.envs.base import StepResult
from sao_jax.envs.tool_env import calculate
from sao_jax.envs.tool_env import CalculatorError
from sao_jax.envs.tool_env import format_number
from sao_jax.envs.tool_env import ToolEnv


def length_level(task: int, levels: int, salt: str = "") -> int:
  """Geometric level of ``task`` in [0, levels): half at 0, a quarter at 1...

  ``salt`` draws an independent level for another property of the task.
  """
  digest = hashlib.blake2b(f"{salt}{int(task)}".encode(),
                           digest_size=8).digest()
  bits = int.from_bytes(digest, "little") | (1 << (levels - 1))
  return min((bits & -bits).bit_length() - 1, levels - 1)


def tool_calls_of(task: int, tool_calls: int) -> int:
  """Tool calls task ``t`` makes: geometric in [0, tool_calls]."""
  return length_level(task, tool_calls + 1, salt="calls:")


class LongTailToolEnv(ToolEnv):
  """`ToolEnv` whose task ``t`` caps actions at ``min_tokens * 2**level(t)``
  and, with ``tool_calls``, makes ``tool_calls_of(t)`` slow tool calls."""

  name_suffix = "+calc+longtail"

  def __init__(self, *args, min_tokens: int = 8, levels: int = 5,
               tool_calls: int = 0, tool_latency_s: float = 0.0, **kwargs):
    super().__init__(*args, **kwargs)
    if min_tokens < 1 or levels < 1 or tool_calls < 0 or tool_latency_s < 0:
      raise ValueError(
          f"min_tokens={min_tokens} and levels={levels} must be >= 1, "
          f"tool_calls={tool_calls} and tool_latency_s={tool_latency_s} >= 0 "
          "(env.longtail_min_tokens, env.longtail_levels, "
          "env.longtail_tool_calls, env.longtail_tool_latency_s).")
    self.min_tokens, self.levels = int(min_tokens), int(levels)
    self.tool_calls, self.tool_latency_s = int(tool_calls), float(tool_latency_s)
    self.fixed_length_actions = self.tool_calls > 0
    self._budget: int | None = None
    self._calls_left = 0

  @classmethod
  def config_kwargs(cls, env_cfg: Any, reward: str | None) -> dict[str, Any]:
    return {**super().config_kwargs(env_cfg, reward),
            "min_tokens": int(env_cfg.longtail_min_tokens),
            "levels": int(env_cfg.longtail_levels),
            "tool_calls": int(env_cfg.longtail_tool_calls),
            "tool_latency_s": float(env_cfg.longtail_tool_latency_s)}

  def reset(self, task: int) -> str:
    self._budget = self.min_tokens << length_level(task, self.levels)
    self._calls_left = (tool_calls_of(task, self.tool_calls)
                        if self.tool_calls else 0)
    return super().reset(task)

  def action_budget(self) -> int | None:
    return self._budget

  def step(self, action_text: str) -> StepResult:
    if self._calls_left <= 0:
      return super().step(action_text)
    self._require_episode()
    self._calls_left -= 1
    time.sleep(self.tool_latency_s)
    try:
      value = format_number(calculate(
          self.template.parse_tool_call(action_text)
          if self.template.is_tool_call(action_text) else action_text))
    except CalculatorError:
      value = "error"
    return StepResult(self.template.format_tool_result(value), 0.0, False,
                      {"tool_result": value})
