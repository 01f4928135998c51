"""Chat templates: how prompts, tool calls and observations look as text.

A `ChatTemplate` is the whole text protocol of an episode (docs/design/models.md
"Tokenizer and chat template"):

  prompt       = prompt_prefix + QUESTION + prompt_suffix         (observation)
  answer turn  = TEXT + turn_end                                  (action)
  tool call    = [TEXT] + call_open + EXPR + call_close
                 [+ turn_end if call_ends_turn]                   (action)
  tool result  = result_prefix + VALUE + result_suffix            (observation)

Each tokenizer carries its own template (`tokenizer.template`): the
sentencepiece tokenizer of from-scratch models uses `SAO_MARKUP` (single-token
markup), a pretrained model's HF tokenizer uses its own chat template (ChatML
for SmolLM2 / Qwen2, see `jinja_template.template_from_jinja`). `stop_tokens`
end an action segment in the sampler; each must be one token of its tokenizer.

A template whose assistant turns carry structured tool calls (Qwen3, Hermes:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`) writes the
expression as a JSON string inside that call (`call_json_arg`); one that trims
message text (Gemma, Llama 3) trims the question and tool value
(`trims_content`); one that writes a tool message as JSON (Llama 3's ipython
turn) escapes the value (`result_json_escaped`).
"""

from __future__ import annotations

import dataclasses
import json
import re


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """One chat/tool-call protocol (see the module docstring).

  Attributes:
    prompt_prefix: text before the user's question (system turn, user header).
    prompt_suffix: text after it, ending with the assistant header.
    turn_end: what closes an assistant turn (a stop token).
    call_open: opens a tool call's expression.
    call_close: closes it.
    call_ends_turn: True if a tool call is a whole assistant turn (ChatML:
      `<tool_call>..</tool_call><|im_end|>`), False if the call token itself
      stops the action (SAO markup).
    result_prefix: text before a tool result (after the call's action).
    result_suffix: text after it, ending with the assistant header.
    stop_tokens: the tokens on which the sampler ends an action segment.
    special_tokens: markup that must encode to single tokens.
    call_json_arg: "" (the call is `call_open + EXPR + call_close`) or the
      argument key of a JSON tool call: `call_open` then ends just before the
      JSON string of the expression, `call_close` starts just after it.
    trims_content: the template strips the question and tool value.
    result_json_escaped: the tool value is written as the inside of a JSON
      string (quotes, backslashes and newlines escaped).
  """

  prompt_prefix: str
  prompt_suffix: str
  turn_end: str
  call_open: str
  call_close: str
  call_ends_turn: bool
  result_prefix: str
  result_suffix: str
  stop_tokens: tuple[str, ...]
  special_tokens: tuple[str, ...]
  call_json_arg: str = ""
  trims_content: bool = False
  result_json_escaped: bool = False

  def format_prompt(self, user_text: str) -> str:
    """A user turn followed by the assistant header the policy continues."""
    if self.trims_content:
      user_text = user_text.strip()
    return self.prompt_prefix + user_text + self.prompt_suffix

  def format_assistant_turn(self, text: str) -> str:
    """Closes an assistant turn."""
    return text + self.turn_end

  def format_tool_call(self, expr: str) -> str:
    """The action text that calls the tool with `expr` (ends the action)."""
    if self.call_json_arg:
      expr = json.dumps(expr, ensure_ascii=False)  # As the template's tojson.
    call = self.call_open + expr + self.call_close
    return call + self.turn_end if self.call_ends_turn else call

  def format_tool_result(self, value: str) -> str:
    """The observation the environment appends after a tool call."""
    if self.trims_content:
      value = value.strip()
    if self.result_json_escaped:
      value = json.dumps(value, ensure_ascii=False)[1:-1]
    return self.result_prefix + value + self.result_suffix

  def _call_tags(self) -> tuple[str, str]:
    """The markers around one call (without the JSON body, if any)."""
    if not self.call_json_arg:
      return self.call_open, self.call_close
    return (self.call_open[:self.call_open.index("{")].strip(),
            self.call_close[self.call_close.rindex("}") + 1:].strip())

  def _strip_turn_end(self, action_text: str) -> str:
    text = action_text.rstrip()
    if self.call_ends_turn and text.endswith(self.turn_end):
      text = text[:-len(self.turn_end)].rstrip()
    return text

  def parse_tool_call(self, action_text: str) -> str | None:
    """The expression of the last complete tool call in `action_text`.

    A JSON call whose body is not a JSON object with
    `arguments[call_json_arg]` is no call (None).
    """
    call_open, call_close = self._call_tags()
    pattern = re.escape(call_open) + r"(.*?)" + re.escape(call_close)
    calls = re.findall(pattern, action_text, re.DOTALL)
    if not calls:
      return None
    if not self.call_json_arg:
      return calls[-1]
    return _json_call_argument(calls[-1], self.call_json_arg)

  def is_tool_call(self, action_text: str) -> bool:
    """Whether the action ends in a complete tool call (else it answers)."""
    return (self.parse_tool_call(action_text) is not None and
            self._strip_turn_end(action_text).endswith(self._call_tags()[1]))

  def reply_text(self, action_text: str) -> str:
    """The final reply of an action: after the last tool result, before the
    end of the turn, surrounding whitespace stripped."""
    text = action_text.rsplit(self.result_suffix, 1)[-1]
    text = text.split(self.turn_end, 1)[0]
    return text.strip()


def _json_call_argument(body: str, key: str) -> str | None:
  """`arguments[key]` of a JSON tool call body (arguments may be a string)."""
  try:
    call = json.loads(body)
    args = call.get("arguments") if isinstance(call, dict) else None
    if isinstance(args, str):
      args = json.loads(args)
  except json.JSONDecodeError:
    return None
  if not isinstance(args, dict) or key not in args:
    return None
  value = args[key]
  return value if isinstance(value, str) else json.dumps(value)


# The markup of sao_jax's own sentencepiece models (one id per piece):
#   <|user|>QUESTION<|end|><|assistant|>ACTION...<|end|>
#   ...<|assistant|>text<|tool_call|>EXPR<|/tool_call|>   (action)
#   <|tool_result|>VALUE<|/tool_result|>                 (observation)
#   more text<|end|>                                     (action)
SAO_MARKUP = ChatTemplate(
    prompt_prefix="<|user|>",
    prompt_suffix="<|end|><|assistant|>",
    turn_end="<|end|>",
    call_open="<|tool_call|>",
    call_close="<|/tool_call|>",
    call_ends_turn=False,
    result_prefix="<|tool_result|>",
    result_suffix="<|/tool_result|>",
    stop_tokens=("<|end|>", "<|/tool_call|>"),
    special_tokens=("<|user|>", "<|assistant|>", "<|tool_call|>",
                    "<|/tool_call|>", "<|tool_result|>", "<|/tool_result|>",
                    "<|end|>"),
)
