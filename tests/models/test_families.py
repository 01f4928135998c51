"""The family registry (models/families/, docs/design/extending.md "A model
family"): every family round-trips its own config, is found by architecture and
by model_type, is the default export of the configs it claims, and the family
modules never import config.py (data flows one way)."""

import ast
import pathlib

import pytest

from sao_jax.models import hf_layout
from sao_jax.models.config import MOE_ARCHITECTURES
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.models.config import SUPPORTED_ARCHITECTURES
from sao_jax.models.config import UnsupportedConfigError
from sao_jax.models.families import registry

FAMILIES_DIR = (pathlib.Path(__file__).resolve().parents[2] / "sao_jax" /
                "models" / "families")
_MOE = dict(num_experts=4, top_k=2, intermediate_size=16)
# architecture -> a tiny config only that family expresses.
CONFIGS = {
    "LlamaForCausalLM": ModelConfig.tiny(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "Qwen2ForCausalLM": ModelConfig.tiny(qkv_bias=True),
    "Qwen3ForCausalLM": ModelConfig.tiny(qk_norm=True),
    "MistralForCausalLM": ModelConfig.tiny(sliding_window=4),
    "Gemma3ForCausalLM": ModelConfig.tiny(
        norm_style="gemma", mlp_activation="gelu_tanh", qk_norm=True,
        tie_embeddings=True, sliding_window=4, local_rope_theta=10.0,
        query_pre_attn_scalar=16.0,
        layer_types=("sliding_attention", "full_attention")),
    "Qwen3MoeForCausalLM": ModelConfig.tiny(
        qk_norm=True, first_dense_layers=1, moe=MoeConfig(**_MOE)),
    "Glm4MoeForCausalLM": ModelConfig.tiny(
        qkv_bias=True, qk_norm=True, rotary_dim=8, first_dense_layers=1,
        moe=MoeConfig(**_MOE, router="sigmoid", n_group=2, n_shared_experts=1,
                      routed_scaling_factor=1.5)),
    "Phi3ForCausalLM": ModelConfig.tiny(rotary_dim=8, sliding_window=4),
    "SmolLM3ForCausalLM": ModelConfig.tiny(nope_layers=(1,)),
    "Olmo2ForCausalLM": ModelConfig.tiny(
        norm_style="olmo", qk_norm=True, qk_norm_full_width=True),
    "Olmo3ForCausalLM": ModelConfig.tiny(
        norm_style="olmo", qk_norm=True, qk_norm_full_width=True,
        sliding_window=4, local_rope_theta=10.0,
        layer_types=("sliding_attention", "full_attention")),
    "DeepseekV3ForCausalLM": ModelConfig.tiny(
        num_kv_heads=4, head_dim=24, kv_lora_rank=16, q_lora_rank=8,
        qk_rope_head_dim=8, v_head_dim=12, first_dense_layers=1,
        moe=MoeConfig(**_MOE, router="sigmoid", n_shared_experts=1)),
    "Qwen3_5ForCausalLM": ModelConfig.tiny(
        norm_style="qwen3_5", qk_norm=True, attn_output_gate=True,
        rotary_dim=4, layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4),
    "Gemma4ForCausalLM": ModelConfig.tiny(
        norm_style="gemma4", mlp_activation="gelu_tanh", qk_norm=True,
        tie_embeddings=True, sliding_window=4, local_rope_theta=10.0,
        query_pre_attn_scalar=1.0, global_head_dim=32, global_kv_heads=1,
        attention_k_eq_v=True, final_logit_softcapping=30.0,
        per_layer_input_size=8,
        layer_types=("sliding_attention", "full_attention")),
    "Qwen3NextForCausalLM": ModelConfig.tiny(
        norm_style="qwen3_5", qk_norm=True, attn_output_gate=True,
        rotary_dim=4, layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, moe=MoeConfig(
            **_MOE, n_shared_experts=1, shared_intermediate_size=24,
            shared_expert_gate=True)),
}
# (family, other): the other, more general family also expresses the
# family's config, which reads back unchanged (Mistral without a window is
# Llama; SmolLM3 holds Llama's configs, Phi-3 Mistral's (not Llama's
# llama3 RoPE); OLMo 3 with full layers only is OLMo 2).
GENERAL = {("LlamaForCausalLM", "MistralForCausalLM"),
           ("MistralForCausalLM", "Phi3ForCausalLM"),
           ("LlamaForCausalLM", "SmolLM3ForCausalLM"),
           ("Olmo2ForCausalLM", "Olmo3ForCausalLM")}


def test_every_registered_family_is_tested_here():
  assert set(SUPPORTED_ARCHITECTURES) == set(CONFIGS)
  assert MOE_ARCHITECTURES == {"Qwen3MoeForCausalLM": "softmax",
                               "Glm4MoeForCausalLM": "sigmoid",
                               "DeepseekV3ForCausalLM": "sigmoid",
                               "Qwen3NextForCausalLM": "softmax"}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_family_round_trips_and_is_the_default_export(arch):
  cfg = CONFIGS[arch]
  assert cfg.hf_architecture() == arch
  hf = cfg.to_hf_config(arch)
  assert hf["architectures"] == [arch]
  assert ModelConfig.from_hf_config(hf) == cfg
  # model_type alone names the family too.
  no_arch = {k: v for k, v in hf.items() if k != "architectures"}
  assert ModelConfig.from_hf_config(no_arch) == cfg
  assert registry.of_hf_config(no_arch).architecture == arch
  for other in SUPPORTED_ARCHITECTURES:
    if other == arch:
      continue
    if (arch, other) in GENERAL:
      assert ModelConfig.from_hf_config(cfg.to_hf_config(other)) == cfg
      continue
    with pytest.raises(UnsupportedConfigError, match=other):
      cfg.to_hf_config(other)


def test_tensor_names_follow_the_family():
  gemma = CONFIGS["Gemma3ForCausalLM"]
  names = {e.hf_name for e in hf_layout.entries(gemma)}
  assert "model.layers.1.pre_feedforward_layernorm.weight" in names
  assert "model.layers.1.post_feedforward_layernorm.weight" in names
  assert len(hf_layout.entries(gemma)) == len(hf_layout.entries(
      CONFIGS["Qwen3ForCausalLM"])) + 2 * 2 - 1  # 2 norms a layer, no head.
  llama = {e.hf_name for e in hf_layout.entries(CONFIGS["LlamaForCausalLM"])}
  assert "model.layers.0.post_attention_layernorm.weight" in llama
  assert not any("feedforward" in n for n in llama)
  # Qwen3-Next fuses its linear layers' projections per key head and names
  # its gated shared expert in the singular.
  nxt = hf_layout.entries(CONFIGS["Qwen3NextForCausalLM"])
  qkvz = [e for e in nxt
          if e.hf_name == "model.layers.0.linear_attn.in_proj_qkvz.weight"]
  assert [(e.path[-1], e.part, e.groups) for e in qkvz] == [
      ("q_proj", (0, 8), 2), ("k_proj", (8, 16), 2), ("v_proj", (16, 32), 2),
      ("z_proj", (32, 48), 2)]
  names = {e.hf_name for e in nxt}
  assert "model.layers.1.mlp.shared_expert_gate.weight" in names
  assert "model.layers.1.mlp.shared_expert.up_proj.weight" in names


def test_unknown_architecture_and_duplicate_registration_are_refused():
  with pytest.raises(UnsupportedConfigError, match="NoSuchLMForCausalLM"):
    ModelConfig.from_hf_config({"architectures": ["NoSuchLMForCausalLM"]})
  with pytest.raises(UnsupportedConfigError, match="model_type"):
    ModelConfig.from_hf_config({"model_type": "no_such_lm"})
  with pytest.raises(UnsupportedConfigError, match="NoSuchLM"):
    ModelConfig.tiny().to_hf_config("NoSuchLMForCausalLM")
  with pytest.raises(ValueError, match="already registered"):
    registry.register(registry.get("LlamaForCausalLM"))


def test_family_modules_never_import_config():
  for path in sorted(FAMILIES_DIR.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        mods = [node.module or ""]
      elif isinstance(node, ast.Import):
        mods = [a.name for a in node.names]
      else:
        continue
      for mod in mods:
        assert mod.startswith(("sao_jax.models.families",
                               "sao_jax.models.layers", "sao_jax.registry",
                               "__future__", "typing", "dataclasses")), (
                                   path.name, mod)
