"""Tool use: the policy may call a calculator before answering.

In the SAO markup (other templates: `chat_template.ChatTemplate`), an
action ending in `<|tool_call|>EXPR<|/tool_call|>` is a tool call: the
environment evaluates EXPR with `calculate` (a whitelist over Python's `ast`,
never `eval`) and answers `<|tool_result|>VALUE<|/tool_result|>` (or
`<|tool_result|>error: ...<|/tool_result|>` for a bad expression; that is the
policy's mistake, not an environment error). Any other action is the final
answer, scored by the task's scorer (reasoning-gym's `score_answer`).
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from sao_jax.envs.base import StepResult
from sao_jax.envs.reasoning_gym_env import ReasoningGymEnv
from sao_jax.envs.reasoning_gym_env import ReasoningGymTasks

MAX_EXPR_CHARS = 256
MAX_EXPONENT = 64
MAX_ABS_VALUE = 10**64

_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
  """The expression is not allowed or cannot be evaluated."""


def _check(value: int | float) -> int | float:
  if not isinstance(value, (int, float)):  # e.g. complex from (-8) ** 0.5.
    raise CalculatorError(f"result {value!r} is not a real number")
  if isinstance(value, float) and not math.isfinite(value):
    raise CalculatorError("result is not finite")
  if abs(value) > MAX_ABS_VALUE:
    raise CalculatorError(f"|value| exceeds {MAX_ABS_VALUE:.0e}")
  return value


def _eval(node: ast.AST) -> int | float:
  if isinstance(node, ast.Expression):
    return _eval(node.body)
  if isinstance(node, ast.Constant):
    if type(node.value) in (int, float):  # Not bool, complex or str.
      return _check(node.value)
    raise CalculatorError(f"literal {node.value!r} is not a number")
  if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
    return _check(_UNARY[type(node.op)](_eval(node.operand)))
  if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
    left, right = _eval(node.left), _eval(node.right)
    if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
      raise CalculatorError(f"exponent {right} exceeds {MAX_EXPONENT}")
    try:
      return _check(_BINOPS[type(node.op)](left, right))
    except ZeroDivisionError:
      raise CalculatorError("division by zero") from None
    except OverflowError:
      raise CalculatorError("overflow") from None
  raise CalculatorError(f"{type(node).__name__} is not allowed")


def calculate(expr: str) -> int | float:
  """Evaluates numeric literals with + - * / // % ** (|exponent| <= 64), unary
  +/- and parentheses. Raises CalculatorError for anything else."""
  if len(expr) > MAX_EXPR_CHARS:
    raise CalculatorError(f"expression longer than {MAX_EXPR_CHARS} chars")
  try:
    tree = ast.parse(expr.strip(), mode="eval")
  except (SyntaxError, ValueError) as e:
    raise CalculatorError(f"cannot parse: {e.msg if hasattr(e, 'msg') else e}"
                          ) from None
  return _eval(tree)


def format_number(value: int | float) -> str:
  """Integers exactly; floats with 12 significant digits, integral ones as ints."""
  if isinstance(value, float):
    if value.is_integer() and abs(value) < 1e15:
      return str(int(value))
    return format(value, ".12g")
  return str(value)


class ToolCallingEnv(ReasoningGymEnv):
  """Multi-turn: tool calls (at most `max_tool_calls`), then an answer.

  An action in the template's tool-call format runs the tool (`run_tool`)
  and its result is the observation; any other action is the final answer,
  scored by the task. Subclasses name the tool (`name_suffix`, `run_tool`).
  """

  name_suffix = ""

  def __init__(self, tasks: ReasoningGymTasks, instruction: str = "",
               max_tool_calls: int = 4, answer: str = "whole",
               reward: str = "exact"):
    super().__init__(tasks, instruction, answer, reward)
    self.name = tasks.name + self.name_suffix
    self.max_tool_calls = max_tool_calls
    self._calls = 0

  @classmethod
  def config_kwargs(cls, env_cfg: Any, reward: str | None) -> dict[str, Any]:
    return {**super().config_kwargs(env_cfg, reward),
            "max_tool_calls": env_cfg.max_tool_calls}

  def reset(self, task: int) -> str:
    self._calls = 0
    return super().reset(task)

  def refuse(self, reason: str) -> str:
    """The observation of a call that cannot run."""
    return f"error: {reason}"

  def run_tool(self, payload: str) -> tuple[str, dict[str, Any]]:
    """(observation, extra step info) of one call's payload."""
    raise NotImplementedError

  def step(self, action_text: str) -> StepResult:
    self._require_episode()
    if not self.template.is_tool_call(action_text):
      return super().step(action_text)  # Final answer.
    payload = self.template.parse_tool_call(action_text)
    self._calls += 1
    if self._calls > self.max_tool_calls:
      value, extra = self.refuse(
          f"more than {self.max_tool_calls} tool calls"), {}
    else:
      value, extra = self.run_tool(payload)
    return StepResult(self.template.format_tool_result(value), 0.0, False,
                      {"tool_call": payload, **extra, "tool_result": value})


class ToolEnv(ToolCallingEnv):
  """Multi-turn: calculator calls (at most `max_tool_calls`), then an answer."""

  name_suffix = "+calc"

  def run_tool(self, payload: str) -> tuple[str, dict[str, Any]]:
    try:
      return format_number(calculate(payload)), {}
    except CalculatorError as e:
      return self.refuse(str(e)), {}
