"""Code tool: the policy runs Python in a sandbox before answering
(docs/design/sandbox.md "Code tool"; the sandbox: sao_jax/sandbox).

A tool call is written in the policy template's own format:
- pretrained (ChatML: SmolLM2, Qwen2) -- Hermes/Qwen2.5 JSON in the call
  markup: `<tool_call>{"name": "python", "arguments": {"code": "..."}}
  </tool_call><|im_end|>` (`arguments` may also be a JSON string);
- from-scratch (`SAO_MARKUP`) -- the code itself:
  `<|tool_call|>print(12*34)<|/tool_call|>`.
The observation (`format_observation`) is the call's stdout; a non-empty
stderr, a non-zero exit status, a time-out, a memory kill and a truncation
are added, each line marked, and the whole is cut to `observation_chars`.
A call that cannot run (bad JSON, another tool's name, over
`max_tool_calls`) is refused with an `error:` observation. Any other action
is the final answer, scored by the task (reasoning-gym's `score_answer`).

The sandbox pool is shared by all code environments of a process
(`shared_pool`), whose counters `publish` copies into the sampler's stats
(TensorBoard `sampler/code_*`). Each step also stays within
`env.step_timeout_s` (config validation: code_wall_s + the sandbox's grace
below it).
"""

from __future__ import annotations

import atexit
import json
import math
import threading
from typing import Any

from sao_jax.envs import function_tasks
from sao_jax.envs.reasoning_gym_env import ReasoningGymTasks
from sao_jax.envs.tool_env import ToolCallingEnv
from sao_jax.sandbox.limits import CallResult
from sao_jax.sandbox.limits import Limits
from sao_jax.sandbox.pool import SandboxPool

TOOL_NAME = "python"
SAO_CALL_OPEN = "<|tool_call|>"  # chat_template.SAO_MARKUP.call_open.
# The tool's counters in the sampler's shared stats (``sampler/<name>`` in
# TensorBoard), each with how a run's samplers' values merge
# (``sampler/stats.py``): counts summed, the exec-time quantiles (over recent
# calls) the current sampler's.
COUNTERS = {"code_calls": "sum", "code_exec_s_p50": "last",
            "code_exec_s_p99": "last", "code_timeouts": "sum",
            "code_memory_kills": "sum", "code_truncations": "sum",
            "code_refusals": "sum", "code_sandbox_errors": "sum"}
STAT_FIELDS = tuple(COUNTERS)
_POOLS: dict[tuple, SandboxPool] = {}
_POOLS_LOCK = threading.Lock()
_REFUSALS = [0]


class CallError(ValueError):
  """A tool call that cannot be run (the policy's mistake)."""


def _unfence(code: str) -> str:
  """Code without a surrounding Markdown fence (```python ... ```)."""
  text = code.strip()
  if text.startswith("```") and text.endswith("```") and "\n" in text:
    return text[text.index("\n") + 1:-3]
  return code


def parse_code(payload: str, json_calls: bool) -> str:
  """The code of a tool call's payload (see the module docstring)."""
  if not json_calls:
    return _unfence(payload)
  try:
    call = json.loads(payload)
  except ValueError as e:
    raise CallError(f"the tool call is not JSON ({e})") from None
  if not isinstance(call, dict) or call.get("name") != TOOL_NAME:
    raise CallError(f'call the tool as {{"name": "{TOOL_NAME}", '
                    '"arguments": {"code": "..."}}')
  args = call.get("arguments", {})
  if isinstance(args, str):
    try:
      args = json.loads(args)
    except ValueError:
      raise CallError("the arguments are not a JSON object") from None
  code = args.get("code") if isinstance(args, dict) else None
  if not isinstance(code, str):
    raise CallError('the arguments hold no "code" string')
  return _unfence(code)


def format_code_call(code: str, template: Any) -> str:
  """The payload that calls the tool with `code` in `template`'s format."""
  if template.call_open == SAO_CALL_OPEN:
    return code
  return json.dumps({"name": TOOL_NAME, "arguments": {"code": code}})


def format_observation(r: CallResult, max_chars: int) -> str:
  """The tool result the policy sees: stdout, then marked extras."""
  lines = [r.stdout.rstrip("\n")] if r.stdout.strip() else []
  if r.stderr.strip():
    lines.append("stderr: " + r.stderr.strip()[-max_chars:])
  if r.timed_out:
    lines.append("[timed out]")
  elif r.memory_error:
    lines.append("[memory limit]")
  elif r.exit_code:
    lines.append(f"[exit status {r.exit_code}]")
  if r.truncated:
    lines.append("[output truncated]")
  if r.sandbox_error:
    lines.append("[sandbox error]")
  text = "\n".join(lines) or "[no output]"
  if len(text) > max_chars:
    mark = "[truncated]"
    text = text[:max_chars - len(mark)] + mark
  return text


def limits_from_config(env_cfg: Any) -> Limits:
  wall = float(env_cfg.code_wall_s)
  return Limits(wall_s=wall, cpu_s=max(1, math.ceil(wall)),
                memory_mb=int(env_cfg.code_memory_mb),
                total_memory_mb=int(env_cfg.code_total_memory_mb),
                processes=int(env_cfg.code_processes))


def shared_pool(env_cfg: Any, packages: bool = True) -> SandboxPool:
  """This process's pool for `env_cfg`'s code_* settings (made once);
  `packages=False`: the standard library only (`SandboxPool`)."""
  key = (str(env_cfg.code_sandbox), str(env_cfg.code_mode),
         int(env_cfg.code_workers), tuple(env_cfg.code_preload),
         limits_from_config(env_cfg), packages)
  with _POOLS_LOCK:
    if key not in _POOLS:
      _POOLS[key] = SandboxPool(key[4], workers=key[2], mode=key[1],
                                mechanism=key[0],
                                preload=key[3] if packages else (),
                                packages=packages)
    return _POOLS[key]


@atexit.register
def close_pools() -> None:
  with _POOLS_LOCK:
    for pool in _POOLS.values():
      pool.close()
    _POOLS.clear()


def tool_stats() -> dict[str, float]:
  """`STAT_FIELDS` over this process's pools (exec seconds: recent calls)."""
  with _POOLS_LOCK:
    pools = list(_POOLS.values())
  times = sorted(t for p in pools for t in p.stats.exec_s)
  counts = {k: sum(p.stats.counts[k] for p in pools) for k in (
      "calls", "timeouts", "memory_kills", "truncations", "sandbox_errors")}

  def quantile(q):
    return times[min(len(times) - 1, int(q * len(times)))] if times else 0.0

  return {"code_calls": counts["calls"], "code_exec_s_p50": quantile(0.5),
          "code_exec_s_p99": quantile(0.99),
          "code_timeouts": counts["timeouts"],
          "code_memory_kills": counts["memory_kills"],
          "code_truncations": counts["truncations"],
          "code_refusals": _REFUSALS[0],
          "code_sandbox_errors": counts["sandbox_errors"]}


def publish(stats: Any) -> None:
  """Puts `tool_stats()` into `stats` (the sampler's `SamplerStats`)."""
  if _POOLS:
    for name, value in tool_stats().items():
      stats.put(name, COUNTERS[name], float(value))


class CodeEnv(ToolCallingEnv):
  """Multi-turn: sandboxed Python calls (at most `max_tool_calls`), then an
  answer."""

  name_suffix = "+python"

  def __init__(self, tasks: ReasoningGymTasks, instruction: str = "",
               max_tool_calls: int = 4, answer: str = "whole",
               reward: str = "exact", *, pool: SandboxPool,
               observation_chars: int = 512):
    super().__init__(tasks, instruction, max_tool_calls, answer, reward)
    self.observation_chars = observation_chars
    self.pool = pool

  @classmethod
  def config_kwargs(cls, env_cfg: Any, reward: str | None) -> dict[str, Any]:
    # Hidden tests: the tool sees no task data either.
    return {**super().config_kwargs(env_cfg, reward),
            "pool": shared_pool(
                env_cfg, packages=env_cfg.dataset != function_tasks.NAME),
            "observation_chars": int(env_cfg.code_observation_chars)}

  def refuse(self, reason: str) -> str:
    with _POOLS_LOCK:
      _REFUSALS[0] += 1
    return super().refuse(reason)

  def run_tool(self, payload: str) -> tuple[str, dict[str, Any]]:
    try:
      code = parse_code(payload, self.template.call_open != SAO_CALL_OPEN)
    except CallError as e:
      return self.refuse(str(e)), {}
    result = self.pool.run(code)
    return (format_observation(result, self.observation_chars),
            {"exec_s": result.exec_s})
