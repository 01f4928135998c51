"""A pretrained model's own tokenizer (`tokenizer.json`) and chat template.

`HFTokenizer.load(dir)` reads a HF model directory (as written by
`sao_jax.models.convert` or downloaded from the Hub): `tokenizer.json` through
the `tokenizers` library, the special tokens from `tokenizer_config.json`,
and the chat template from `chat_template.jinja` (or the config's
`chat_template`). transformers is not needed at run time.

The chat template becomes a `ChatTemplate` by rendering the Jinja source with
sentinel messages (`jinja_template.template_from_jinja`, the same sandboxed
Jinja settings as transformers' `apply_chat_template`), so the sampler, the
environments and SFT write exactly the text the model was tuned on. Template
variables (`env.chat_template_kwargs`, e.g. Qwen3's `enable_thinking`), a
system message (`env.system_prompt`) and the declared tools travel with the
tokenizer (`serialized_proto`). For SmolLM2 (ChatML) an episode with a tool
call reads:

  <|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\nQ<|im_end|>\\n
  <|im_start|>assistant\\n                                   (prompt)
  <tool_call>EXPR</tool_call><|im_end|>                      (action)
  \\n<|im_start|>tool\\nVALUE<|im_end|>\\n<|im_start|>assistant\\n (observation)
  ANSWER<|im_end|>                                           (action)

which is what `apply_chat_template` renders for the messages user, assistant
(the call), tool (the value), assistant (the answer).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import tokenizers

from sao_jax.tokenization import jinja_template

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# Prefix of `serialized_proto()`, which tells the blob from a SentencePiece one.
SERIAL_MAGIC = b"sao_jax.hf_tokenizer/1\n"
TemplateError = jinja_template.TemplateError


class HFTokenizer:
  """`tokenizers` tokenizer + special tokens + chat template of a HF model."""

  def __init__(self, tokenizer_json: str, config: dict[str, Any],
               chat_template: str,
               template_kwargs: Mapping[str, Any] | None = None,
               system: str = "",
               tools: Sequence[Mapping[str, Any]] | None = None):
    self._json = tokenizer_json
    self._config = dict(config)
    self._chat_template = chat_template
    self._template_args = {"template_kwargs": dict(template_kwargs or {}),
                           "system": system,
                           "tools": [dict(t) for t in tools or ()]}
    self._tok = tokenizers.Tokenizer.from_str(tokenizer_json)
    self._specials = {k: self._token_text(config.get(k)) for k in (
        "bos_token", "eos_token", "pad_token", "unk_token")}
    added = [t.content for t in self._tok.get_added_tokens_decoder().values()]
    self.template = jinja_template.template_from_jinja(
        chat_template, added,
        {**self._specials, **self._template_args["template_kwargs"]},
        system=system, tools=self._template_args["tools"])
    # No eos in the config (a base model's): the template's stop token.
    self._specials["eos_token"] = (self._specials["eos_token"]
                                   or self.template.turn_end)
    self._ids = {}
    for tok in set(self.template.special_tokens) | set(
        self.template.stop_tokens) | {v for v in self._specials.values() if v}:
      tid = self._tok.token_to_id(tok)
      if tid is None or self._tok.encode(
          tok, add_special_tokens=False).ids != [tid]:
        raise ValueError(
            f"special token {tok!r} of the chat template is not a single "
            f"token of {TOKENIZER_FILE}.")
      self._ids[tok] = tid

  @staticmethod
  def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # AddedToken serialised as a dict.
      value = value.get("content")
    return value or ""

  @classmethod
  def load(cls, path: str | os.PathLike[str],
           template_kwargs: Mapping[str, Any] | None = None, system: str = "",
           tools: Sequence[Mapping[str, Any]] | None = None) -> HFTokenizer:
    """Reads `tokenizer.json`, `tokenizer_config.json` and the template.

    `template_kwargs`, `system` and `tools`: as `template_from_jinja`'s
    `variables`, `system` and `tools`.
    """
    path = os.fspath(path)
    files = {}
    for name in (TOKENIZER_FILE, CONFIG_FILE):
      full = os.path.join(path, name)
      if not os.path.isfile(full):
        raise FileNotFoundError(
            f"{full} not found: a HF tokenizer directory needs "
            f"{TOKENIZER_FILE} and {CONFIG_FILE} (convert a GGUF file with "
            "`python -m sao_jax.models.convert`).")
      with open(full, encoding="utf-8") as f:
        files[name] = f.read()
    config = json.loads(files[CONFIG_FILE])
    template = config.get("chat_template")
    template_path = os.path.join(path, TEMPLATE_FILE)
    if os.path.isfile(template_path):
      with open(template_path, encoding="utf-8") as f:
        template = f.read()
    if not isinstance(template, str) or not template:
      raise ValueError(
          f"{path} has no chat template ({TEMPLATE_FILE} or `chat_template` in "
          f"{CONFIG_FILE}); sao_jax needs one for a pretrained model.")
    return cls(files[TOKENIZER_FILE], config, template, template_kwargs,
               system, tools)

  def serialized_proto(self) -> bytes:
    """Everything needed to rebuild this tokenizer (`from_serialized`)."""
    args = dict(self._template_args)
    # Key order of a tool schema shows in the prompt (tojson): kept as is.
    args["tools"] = json.dumps(args["tools"])
    blob = json.dumps({"tokenizer_json": self._json, "config": self._config,
                       "chat_template": self._chat_template, **args},
                      sort_keys=True)
    return SERIAL_MAGIC + blob.encode("utf-8")

  @classmethod
  def from_serialized(cls, blob: bytes) -> HFTokenizer:
    if not blob.startswith(SERIAL_MAGIC):
      raise ValueError("not a serialized HFTokenizer.")
    d = json.loads(blob[len(SERIAL_MAGIC):].decode("utf-8"))
    return cls(d["tokenizer_json"], d["config"], d["chat_template"],
               d.get("template_kwargs"), d.get("system", ""),
               json.loads(d.get("tools", "[]")))

  def _special_id(self, key: str, fallback: str) -> int:
    tok = self._specials[key] or self._specials[fallback]
    return self._ids[tok]

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def pad_id(self) -> int:
    return self._special_id("pad_token", "eos_token")

  @property
  def eos_id(self) -> int:
    return self._ids[self._specials["eos_token"]]

  @property
  def bos_id(self) -> int:
    return self._special_id("bos_token", "eos_token")

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end an action segment (the end of the assistant turn)."""
    return tuple(dict.fromkeys(
        [self._ids[t] for t in self.template.stop_tokens] + [self.eos_id]))

  def token_id(self, special: str) -> int:
    """The id of a special token of the template or tokenizer config."""
    try:
      return self._ids[special]
    except KeyError:
      raise KeyError(f"{special!r} is not a special token; expected one of "
                     f"{sorted(self._ids)}.") from None

  def encode(self, text: str) -> list[int]:
    """Token ids of `text` (no bos/eos added; special tokens matched)."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, special tokens included (the template parses them)."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def id_to_piece(self, token_id: int) -> str:
    return self._tok.id_to_token(int(token_id))
