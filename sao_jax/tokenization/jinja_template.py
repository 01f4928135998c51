"""A checkpoint's Jinja chat template as a `ChatTemplate` (docs/design/models.md
"Tokenizer and chat template").

`template_from_jinja` renders the template a few times with sentinel messages
(in the same sandbox as transformers' `apply_chat_template`: trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now` and a `tojson`
that does not HTML-escape) and reads the pieces of an episode off the text:

- prompt: a user turn (after the optional system turn) and the generation
  prompt; template variables such as Qwen3's `enable_thinking` change it;
- the stop token: the special token the template writes right after an
  assistant reply (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`), not the
  tokenizer's eos (Gemma's eos `<eos>` never closes a turn);
- the observation after a tool call: what follows the reply's stop token up
  to a `tool` message's text and after it. A template without a tool role
  (Gemma 3: roles must alternate) gets the value as a user turn;
- the call: `<tool_call>EXPR</tool_call>` in the reply's text, or, when
  `tools` are declared and the template renders an assistant message's
  `tool_calls` after its text (Qwen3, Hermes), that JSON call with the
  expression as the string argument `expression`.

Only what these renderings show is kept, so an episode is append-only even
where the template would rewrite history (Qwen3 drops earlier turns' thinking
and, with thinking off, their empty think block): the sampler trains on the
tokens it sampled.
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Iterable, Mapping, Sequence

from sao_jax.tokenization.chat_template import ChatTemplate

# Tool-call markup inside an assistant turn when the template has no tool-call
# format of its own (the Hermes / Qwen2.5 tags, as plain text).
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# The tool sao_jax's tool environments offer (envs/tool_env.py), declared to a
# template that takes `tools` (OpenAI function schema, as transformers takes).
CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluates an arithmetic expression; returns its value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {
                "type": "string",
                "description": "The expression, e.g. 12 + 7 * 3."}},
            "required": ["expression"],
        },
    },
}
CALL_ARG = "expression"
# Sentinels: letters only (they survive tojson and trim; `| lower` breaks them).
_Q, _A, _T, _E, _C = ("SAOQUESTIONX", "SAOANSWERX", "SAOTOOLVALUEX",
                      "SAOEXPRESSIONX", "SAOCONTENTX")
_ESCAPED_T = 'SAO"TOOL\nVALUEX'


class TemplateError(ValueError):
  """A chat template this project cannot express as a `ChatTemplate`."""


def render(source: str, messages: Sequence[Mapping[str, Any]],
           variables: Mapping[str, Any] | None = None,
           add_generation_prompt: bool = True) -> str:
  """`apply_chat_template(messages, tokenize=False, **variables)`'s text."""
  from jinja2 import exceptions  # pylint: disable=g-import-not-at-top
  from jinja2 import ext  # pylint: disable=g-import-not-at-top
  from jinja2 import sandbox  # pylint: disable=g-import-not-at-top

  def raise_exception(message):
    raise TemplateError(f"the chat template raised: {message}")

  def tojson(x, ensure_ascii=False, indent=None, separators=None,
             sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = (
      lambda fmt: datetime.datetime.now().strftime(fmt))
  try:
    return env.from_string(source).render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        **dict(variables or {}))
  except exceptions.TemplateError as e:
    raise TemplateError(f"the chat template failed to render: {e}") from e


def _once(text: str, sentinel: str, what: str) -> tuple[str, str]:
  if text.count(sentinel) != 1:
    raise TemplateError(f"the chat template does not render {what} verbatim "
                        "once (it rewrites message text, e.g. `| lower`).")
  before, after = text.split(sentinel)
  return before, after


def template_from_jinja(source: str, added_tokens: Iterable[str],
                        variables: Mapping[str, Any] | None = None,
                        system: str = "",
                        tools: Sequence[Mapping[str, Any]] | None = None
                        ) -> ChatTemplate:
  """The `ChatTemplate` a HF Jinja chat template renders (module docstring).

  Args:
    source: the Jinja chat template.
    added_tokens: the tokenizer's added (special) tokens; the stop token is
      the one the template writes right after an assistant reply.
    variables: template variables (bos_token, ..., and the run's
      `env.chat_template_kwargs`, e.g. `enable_thinking=False`).
    system: a system message before the user turn ("" for none).
    tools: tool schemas the template declares (e.g. `[CALCULATOR_TOOL]`).

  Raises:
    TemplateError: the template does not render a user turn, an assistant
      turn closed by a special token and a tool (or user) turn after it.
  """
  variables = dict(variables or {})
  if tools:
    variables["tools"] = [dict(t) for t in tools]
  added = sorted(set(added_tokens), key=len, reverse=True)
  head = [{"role": "system", "content": system}] if system else []
  user = {"role": "user", "content": _Q}

  def go(messages, generation_prompt=True):
    return render(source, head + messages, variables, generation_prompt)

  prefix, suffix = _once(go([user]), _Q, "the user message")
  padded = go([{"role": "user", "content": f" {_Q} "}])
  trims = f" {_Q} " not in padded and _Q in padded
  _, after_reply = _once(go([user, {"role": "assistant", "content": _A}],
                            False), _A, "the assistant message")
  turn_end = next((t for t in added if t and after_reply.startswith(t)), "")
  if not turn_end:
    raise TemplateError(
        "the chat template does not close an assistant turn with a special "
        f"token of the tokenizer (after the reply: {after_reply[:20]!r}).")

  def tool_turn(role, value, messages_before):
    return go([user, *messages_before, {"role": role, "content": value}])

  reply = {"role": "assistant", "content": _A}
  role = "tool"
  try:
    dialog = tool_turn(role, _T, [reply])
  except TemplateError:
    dialog = ""
  if dialog.count(_T) != 1:  # No tool role (Gemma): the value as a user turn.
    role = "user"
    dialog = tool_turn(role, _T, [reply])
  between, result_suffix = _once(_once(dialog, _A, "the assistant message")[1],
                                 _T, "the tool message")
  if not between.startswith(turn_end):
    raise TemplateError(
        f"the chat template does not follow an assistant turn's {turn_end!r} "
        f"with the tool turn (got {between[:20]!r}).")
  escaped = tool_turn(role, _ESCAPED_T, [reply])
  json_escaped = (_ESCAPED_T not in escaped
                  and json.dumps(_ESCAPED_T)[1:-1] in escaped)
  call_open, call_close, call_arg = CALL_OPEN, CALL_CLOSE, ""
  if tools:
    call = _json_call(tool_turn(role, _T, [{
        "role": "assistant", "content": _C, "tool_calls": [{
            "type": "function", "function": {
                "name": tools[0]["function"]["name"],
                "arguments": {CALL_ARG: _E}}}]}]), turn_end)
    if call is not None:
      call_open, call_close, call_arg = *call, CALL_ARG
  pieces = (prefix + suffix + turn_end + between + result_suffix + call_open
            + call_close)
  return ChatTemplate(
      prompt_prefix=prefix, prompt_suffix=suffix, turn_end=turn_end,
      call_open=call_open, call_close=call_close, call_ends_turn=True,
      result_prefix=between[len(turn_end):], result_suffix=result_suffix,
      stop_tokens=(turn_end,),
      special_tokens=tuple(t for t in sorted(set(added)) if t and t in pieces),
      call_json_arg=call_arg, trims_content=trims,
      result_json_escaped=json_escaped)


def _json_call(dialog: str, turn_end: str) -> tuple[str, str] | None:
  """(call_open, call_close) around the JSON string of the expression.

  None when the template does not write the message's `tool_calls` after its
  text within the turn (it ignores them, or puts them elsewhere).
  """
  literal = json.dumps(_E)
  if dialog.count(_C) != 1 or dialog.count(literal) != 1:
    return None
  turn = dialog.split(_C)[1].split(turn_end)[0]
  if literal not in turn:
    return None
  call_open, call_close = turn.split(literal)
  call_open = call_open.lstrip()  # The newline between text and the call.
  if "{" not in call_open or "}" not in call_close:
    return None
  return call_open, call_close
