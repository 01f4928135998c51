"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`, model_type qwen2): Llama with biases
on the q/k/v projections (`ModelConfig.qkv_bias`). docs/design/extending.md."""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry

ARCH = "Qwen2ForCausalLM"


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Qwen2 config."""
  common.refuse(hf, ARCH, "use_sliding_window")
  return {**common.base_from_hf(hf), "qkv_bias": True, "qk_norm": False}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF Qwen2 config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, qkv_bias=(True,), notes={
      "qkv_bias": "Qwen2ForCausalLM always has q/k/v biases"})
  return {**common.base_to_hf(cfg, ARCH, "qwen2"), "use_sliding_window": False}


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="qwen2", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.qkv_bias, priority=40))
