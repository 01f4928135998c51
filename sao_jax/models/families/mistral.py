"""Mistral (`MistralForCausalLM`): Llama with an optional sliding window.

The layers are Llama's (no biases, SiLU gated MLP, untied or tied head) and
so are the tensor names (models/hf_layout.py); the one extra field is
`ModelConfig.sliding_window`, honoured by every attention path through
`MaskSpec.window` (layers/masks.py). docs/design/extending.md.
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError

ARCH = "MistralForCausalLM"


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Mistral config.

  `sliding_window` None (or absent) is full causal attention, as in
  transformers' MistralModel (create_causal_mask).
  """
  if hf.get("layer_types"):
    raise UnsupportedConfigError(
        "Mistral layer_types (alternating sliding/full layers, Ministral) "
        "is not supported: every layer must share one sliding_window.")
  common.refuse(hf, "Mistral", "attention_bias", "mlp_bias")
  window = hf.get("sliding_window")
  if window is not None and int(window) < 1:
    raise UnsupportedConfigError(
        f"Mistral sliding_window={window} must be None or >= 1.")
  return {**common.base_from_hf(hf), "qkv_bias": False, "qk_norm": False,
          "sliding_window": int(window or 0)}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF Mistral config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, sliding=True, notes={
      "qkv_bias": "its attention_bias also adds an o_proj bias"})
  return {**common.base_to_hf(cfg, ARCH, "mistral"),
          "sliding_window": cfg.sliding_window or None}


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="mistral", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: bool(cfg.sliding_window), priority=20))
