"""OLMo 2 (`Olmo2ForCausalLM`, model_type olmo2).

Llama's projections and SwiGLU MLP in post-norm blocks: x + norm(attn(x)),
then x + norm(mlp(x)), no norm before either (`norm_style='olmo'`; HF
`post_attention_layernorm` and `post_feedforward_layernorm` are our
`post_attn_norm` and `post_mlp_norm`), and q/k norms over the whole q_proj /
k_proj output, all heads at once (`qk_norm_full_width`, weights [H*Dh] /
[K*Dh]). docs/design/extending.md "A model family".
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry

ARCH = "Olmo2ForCausalLM"
# An OLMo block's two norms (ours, HF), in block order.
NORM_NAMES = (("post_attn_norm", "post_attention_layernorm"),
              ("post_mlp_norm", "post_feedforward_layernorm"))


def block_fields(hf: Mapping[str, Any], family: str) -> dict[str, Any]:
  """The `ModelConfig` fields OLMo 2 and 3 share."""
  common.refuse(hf, family, "attention_bias")
  return {"qkv_bias": False, "qk_norm": True, "qk_norm_full_width": True,
          "norm_style": "olmo"}


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF OLMo 2 config."""
  return {**common.base_from_hf(hf), **block_fields(hf, "OLMo 2")}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF OLMo 2 config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, qk_norm=(True,), norm_style="olmo",
                      full_width_qk=True)
  return {**common.base_to_hf(cfg, ARCH, "olmo2"), "attention_bias": False}


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="olmo2", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.norm_style == "olmo", priority=12,
    norm_names=NORM_NAMES))
