"""Mistral (`MistralForCausalLM`): Llama with an optional sliding window.

The layers are Llama's (no biases, SiLU gated MLP, untied or tied head) and
so are the tensor names (models/hf.py `_layout`); the one extra field is
`ModelConfig.sliding_window`, honoured by every attention path through
`MaskSpec.window` (layers/masks.py). docs/DESIGN.md §8.
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families.errors import UnsupportedConfigError


def mistral_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The Mistral-only `ModelConfig` fields of a HF Mistral config.

  `sliding_window` None (or absent) is full causal attention, as in
  transformers' MistralModel (create_causal_mask).
  """
  if hf.get("layer_types"):
    raise UnsupportedConfigError(
        "Mistral layer_types (alternating sliding/full layers, Ministral) "
        "is not supported: every layer must share one sliding_window.")
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key, False):
      raise UnsupportedConfigError(f"Mistral {key}=True is not supported.")
  window = hf.get("sliding_window")
  if window is not None and int(window) < 1:
    raise UnsupportedConfigError(
        f"Mistral sliding_window={window} must be None or >= 1.")
  return {"sliding_window": int(window or 0)}


def mistral_to_hf(cfg: Any) -> dict[str, Any]:
  """The Mistral-only HF config keys of `ModelConfig` `cfg`."""
  return {"sliding_window": cfg.sliding_window or None}
