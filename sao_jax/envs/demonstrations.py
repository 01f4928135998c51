"""Task demonstrations: one solved problem as the sampler's segments.

The SFT warm start trains on these (``train.warm_start.sft_examples``) and
``envs.task_sizing`` measures them, so the lengths a run derives are the
lengths its demonstrations and rollouts have. A demonstration is a list of
``(token ids, trained)`` segments: the prompt (question + ``env.instruction``
in the template, not trained), then the policy's actions (trained) and any
environment observations (tool results, not trained). An entry with
``tool_calls`` (the repair tasks': (call payload, observation) pairs, each
what the environment returns) makes those calls in order. Every task's answer is
``str(entry["answer"])`` as the final assistant turn, the form the held-out
scorer reads back under ``env.answer='whole'``.
"""

from __future__ import annotations

from typing import Any, Sequence

from sao_jax.envs import code_env
from sao_jax.envs import evolving
from sao_jax.envs import tool_env

# (token ids, trained on) pairs, in order.
Segments = list[tuple[Sequence[int], bool]]


def demonstration(entry: dict[str, Any], index: int, tokenizer: Any, *,
                  tool_every: int = 0, styles: tuple[str, ...] = (),
                  instruction: str = "", code_tool: bool = False) -> Segments:
  """Segments of the demonstration of ``entry`` (task ``index``).

  Args:
    entry: A reasoning-gym entry (``question``, ``answer``, ``metadata``).
    index: The task's index (selects the tool use and the style).
    tokenizer: A ``text_tokenizer.TextTokenizer``.
    tool_every: Every k-th task calls the calculator with the entry's
      ``metadata['expression']`` (when it has one) before answering; 0: none.
    styles: The evolving env's answer styles (task i uses
      ``styles[i % len(styles)]``); () = the plain answer.
    instruction: ``env.instruction``, appended to the question.
    code_tool: the tool is the code tool (``env.name='code'``): the call is
      ``print(EXPRESSION)`` in the template's call format
      (``code_env.format_code_call``) and the result what it prints.
  """
  template = tokenizer.template
  segments: Segments = [(tokenizer.encode(
      template.format_prompt(entry["question"] + instruction)), False)]
  for call, value in entry.get("tool_calls", ()):
    segments += [
        (tokenizer.encode(template.format_tool_call(call)), True),
        (tokenizer.encode(template.format_tool_result(value)), False)]
  expr = entry.get("metadata", {}).get("expression")
  if tool_every and index % tool_every == 0 and expr is not None:
    if code_tool:
      call = code_env.format_code_call(f"print({expr})", template)
      value = str(tool_env.calculate(expr))  # What print() writes.
    else:
      call = expr
      value = tool_env.format_number(tool_env.calculate(expr))
    segments += [
        (tokenizer.encode(template.format_tool_call(call)), True),
        (tokenizer.encode(template.format_tool_result(value)), False)]
  answer = str(entry["answer"])
  if styles:
    answer = evolving.format_style(answer, styles[index % len(styles)])
  segments.append(
      (tokenizer.encode(template.format_assistant_turn(answer)), True))
  return segments


def tool_every(tool_frac: float) -> int:
  """Every k-th demonstration calls the tool for a ``tool_frac`` share."""
  return round(1.0 / tool_frac) if tool_frac > 0 else 0


def settings_from(config: Any) -> dict[str, Any]:
  """``demonstration`` keyword arguments of a run (``config``)."""
  styles = (tuple(config.env.styles) if str(config.env.name) == "evolving"
            else ())
  return {"tool_every": tool_every(float(config.train.sft_tool_frac)),
          "styles": styles,
          "instruction": str(config.env.get("instruction", "")),
          "code_tool": str(config.env.name) == "code"}
