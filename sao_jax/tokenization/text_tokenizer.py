"""The tokenizer interface the sampler, environments, SFT and eval rely on.

Two implementations: `tokenizer.Tokenizer` (sao_jax's own SentencePiece
models, `chat_template.SAO_MARKUP`) and `hf_tokenizer.HFTokenizer` (a
pretrained model's `tokenizer.json` and its own chat template).
"""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from sao_jax.tokenization.chat_template import ChatTemplate


@runtime_checkable
class TextTokenizer(Protocol):
  """Text <-> ids, the special ids, and the chat template of one model."""

  template: ChatTemplate

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def eos_id(self) -> int: ...

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids on which the sampler ends an action segment."""

  def token_id(self, special: str) -> int: ...

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def serialized_proto(self) -> bytes:
    """Bytes `from_serialized` rebuilds the tokenizer from (sampler process)."""


def from_serialized(blob: bytes) -> TextTokenizer:
  """The tokenizer `blob = tokenizer.serialized_proto()` came from."""
  from sao_jax.tokenization import hf_tokenizer  # pylint: disable=g-import-not-at-top
  from sao_jax.tokenization import tokenizer  # pylint: disable=g-import-not-at-top

  if blob.startswith(hf_tokenizer.SERIAL_MAGIC):
    return hf_tokenizer.HFTokenizer.from_serialized(blob)
  return tokenizer.Tokenizer(blob)
