"""Llama 2/3.x (`LlamaForCausalLM`, model_type llama).

RMSNorm, RoPE (plain or scaled: `linear`, `llama3`, `yarn`, `dynamic`, in
models/layers/rope.py), GQA without biases, SiLU gated MLP, untied or tied
head: the shared layers' defaults and the HF tensor names every Llama-like
family reuses (models/hf_layout.py). docs/design/extending.md.
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry

ARCH = "LlamaForCausalLM"


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Llama config."""
  common.refuse(hf, "Llama", "attention_bias", "mlp_bias")
  return {**common.base_from_hf(hf), "qkv_bias": False, "qk_norm": False}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF Llama config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, notes={
      "qkv_bias": "its attention_bias also adds an o_proj bias"})
  return {**common.base_to_hf(cfg, ARCH, "llama"), "attention_bias": False,
          "mlp_bias": False}


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="llama", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: True, priority=100))
