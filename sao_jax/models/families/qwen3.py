"""Qwen3 dense (`Qwen3ForCausalLM`, model_type qwen3): Llama with RMSNorm
over each head's q and k before RoPE (`ModelConfig.qk_norm`, HF
`self_attn.{q,k}_norm`), an explicit head_dim and no biases.
docs/design/extending.md."""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError

ARCH = "Qwen3ForCausalLM"


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Qwen3 config."""
  common.refuse(hf, ARCH, "use_sliding_window")
  if hf.get("attention_bias", False):
    raise UnsupportedConfigError(
        "Qwen3 attention_bias=True (bias on o_proj too) is not supported.")
  return {**common.base_from_hf(hf), "qkv_bias": False, "qk_norm": True}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF Qwen3 config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, qk_norm=(True,), notes={
      "qk_norm": "Qwen3ForCausalLM: q/k norms, no biases"})
  return {**common.base_to_hf(cfg, ARCH, "qwen3"), "use_sliding_window": False,
          "attention_bias": False}


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="qwen3", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.qk_norm, priority=30))
