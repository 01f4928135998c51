"""Every supported family against transformers, float32: one row each.

A row of FAMILIES is a tiny random checkpoint of one architecture (built by
transformers, every weight perturbed, eager attention) and what our import
must read from it. Every row runs the same checks: the logits of a
left-padded batch within 1e-4 of transformers in each layout the row lists
(scanned or unrolled layers, dense or blockwise attention), the parameter
counts, export -> transformers reload -> the same tensors and logits, and a
sharded bfloat16 copy loaded onto a mesh. A row also names the checks of its
own features (CHECKS): a sliding window that really applies, packed rows,
greedy decoding through the KV cache (a left-padded batch against
`generate`, or each prompt alone with decode_parity), q/k norms, MoE
routing and its replay (R3), malformed checkpoints; and, with a tiny
`ModelConfig`, its conversion and the configs it refuses.

A new family is a new row: `test_every_supported_architecture_has_a_row`
fails until it has one.
"""

from collections.abc import Callable, Mapping
import copy
import dataclasses
import json
import os
import pathlib
import shutil
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_parity

from sao_jax.models import hf
from sao_jax.models import transformer as tm
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.models.config import SUPPORTED_ARCHITECTURES
from sao_jax.models.config import UnsupportedConfigError
from sao_jax.sampler import decoding
from sao_jax.train import memory
from sao_jax.train import optim

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import hf_reference  # pylint: disable=g-import-not-at-top,wrong-import-position
safetensors_numpy = pytest.importorskip("safetensors.numpy")

pytestmark = pytest.mark.ref

WINDOW = 4
NEW_TOKENS = 32
# Layout name -> (scan_layers, attention); "default": load_hf_checkpoint's.
LAYOUTS = {
    "default": None,
    "scan-dense": (True, "dense"),
    "scan-blockwise": (True, "blockwise"),
    "unrolled-dense": (False, "dense"),
    "unrolled-blockwise": (False, "blockwise"),
}
ALL_LAYOUTS = tuple(k for k in LAYOUTS if k != "default")
# The feature checks a row can name (each a test below).
CHECKS = ("sliding_window", "packed_rows", "batch_decode", "prompt_decode",
          "qk_norm", "moe", "malformed_checkpoints", "nope_layers")


@dataclasses.dataclass(frozen=True)
class Family:
  """One architecture's tiny random checkpoint and what must hold for it.

  Attributes:
    arch: the transformers class; also our `ModelConfig.hf_architecture()`.
    hf_config: makes its transformers config.
    reads: `ModelConfig` attributes (dotted for nested ones) and the values
      `load_hf_checkpoint` must read from the checkpoint.
    batch: `hf_reference.left_padded_batch` arguments of the test batch.
    weights: `hf_reference.save_random_model` arguments.
    layouts: the LAYOUTS its logits are compared in.
    saved: items the exported config.json must hold.
    checks: the CHECKS of its features it runs.
    tiny: `ModelConfig.tiny` arguments of the config whose conversion
      `test_tiny_config_converts_and_refuses` checks; None: no such check.
    export_refusals: (`ModelConfig.tiny` arguments, None for `tiny`'s;
      architecture; words of the error) of refused exports.
    import_refusals: (config.json items added to `tiny`'s; words of the
      error) of refused imports.
    marks: pytest marks of all its tests.
    atol: the most |logits - transformers' logits| on the batch (1e-4,
      the issue's bound; rows added since hold a tighter one, a few times
      their measured figure, so a small mismatch such as a norm's epsilon
      shows).
  """
  arch: str
  hf_config: Callable[[], Any]
  reads: Mapping[str, Any]
  batch: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  weights: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  layouts: tuple[str, ...] = ("default",)
  saved: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  checks: frozenset[str] = frozenset()
  tiny: Mapping[str, Any] | None = None
  export_refusals: tuple[tuple[Mapping[str, Any] | None, str, str], ...] = ()
  import_refusals: tuple[tuple[Mapping[str, Any], str], ...] = ()
  marks: tuple[Any, ...] = ()
  atol: float = 1e-4


_DENSE = dict(vocab_size=128, hidden_size=64, intermediate_size=96,
              num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, attn_implementation="eager")
_MOE = dict(vocab_size=96, hidden_size=32, intermediate_size=48,
            moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-5,
            tie_word_embeddings=False, attn_implementation="eager")
_GEMMA3_LAYER_TYPES = ("sliding_attention", "full_attention",
                       "sliding_attention", "sliding_attention")


def _gemma3_config() -> Any:
  config = transformers.Gemma3TextConfig(
      **{**_DENSE, "num_hidden_layers": 4}, head_dim=16, rms_norm_eps=1e-6,
      sliding_window=WINDOW, max_position_embeddings=128,
      query_pre_attn_scalar=24, layer_types=list(_GEMMA3_LAYER_TYPES),
      rope_parameters={
          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
          "full_attention": {"rope_type": "linear", "factor": 2.0,
                             "rope_theta": 10000.0}})
  config.architectures = ["Gemma3ForCausalLM"]
  return config


def _phi3_config() -> Any:
  """Phi-4-mini's features: half the head rotated, LongRoPE (short factors:
  every test sequence is within original_max_position_embeddings; the long
  ones are tests/models/test_rope_scaling.py's), a sliding window."""
  return transformers.Phi3Config(
      **_DENSE, rms_norm_eps=1e-5, tie_word_embeddings=False,
      sliding_window=WINDOW, max_position_embeddings=128,
      original_max_position_embeddings=64, pad_token_id=0,
      rope_parameters={"rope_type": "longrope", "rope_theta": 500.0,
                       "partial_rotary_factor": 0.5,
                       "short_factor": [1.0, 1.3, 2.0, 3.5],
                       "long_factor": [4.0, 6.0, 9.0, 16.0]})


def _olmo3_config() -> Any:
  """A sliding layer (its own RoPE base) then a full one (YaRN-scaled)."""
  return transformers.Olmo3Config(
      **_DENSE, rms_norm_eps=1e-6, tie_word_embeddings=False,
      sliding_window=WINDOW, max_position_embeddings=128,
      layer_types=["sliding_attention", "full_attention"],
      rope_parameters={
          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
          "full_attention": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 32,
                             "rope_theta": 10000.0}})


_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12)


def _deepseek_v3_config() -> Any:
  """MLA with a query bottleneck and YaRN (mscale_all_dim scales the
  scores) over GLM-4.5's routing: groups, bias, scaling, a shared expert,
  a dense first layer."""
  return transformers.DeepseekV3Config(
      **{**_MOE, "num_key_value_heads": 4, "vocab_size": 128}, **_MLA,
      q_lora_rank=24,
      qk_nope_head_dim=16, n_routed_experts=8, n_group=2, topk_group=1,
      n_shared_experts=1, routed_scaling_factor=1.5, first_k_dense_replace=1,
      pad_token_id=0, max_position_embeddings=128,
      rope_parameters={"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 32, "mscale": 1.0,
                       "mscale_all_dim": 1.0, "rope_theta": 500.0})


_QWEN3_5_LAYER_TYPES = ("linear_attention", "full_attention") * 2
_QWEN3_5_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4,
                       linear_key_head_dim=16, linear_value_head_dim=8,
                       linear_conv_kernel_dim=4)


def _qwen3_5_config() -> Any:
  """Linear, full, linear, full (a pattern of two, scanned twice); gated
  full attention rotating a quarter of each head."""
  config = transformers.Qwen3_5TextConfig(
      **{**_DENSE, "num_hidden_layers": 4}, head_dim=16, **_QWEN3_5_LINEAR,
      rms_norm_eps=1e-6, tie_word_embeddings=False,
      layer_types=list(_QWEN3_5_LAYER_TYPES),
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                       "partial_rotary_factor": 0.25})
  config.architectures = ["Qwen3_5ForCausalLM"]
  return config


_QWEN3_NEXT_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=8, linear_value_head_dim=6,
                          linear_conv_kernel_dim=4)


def _qwen3_next_config() -> Any:
  """A linear then a gated full-attention layer (one repeat), each with
  eight routed experts and a gated shared expert of its own width."""
  return transformers.Qwen3NextConfig(
      **{**_MOE, "num_hidden_layers": 2}, num_experts=8,
      shared_expert_intermediate_size=24, **_QWEN3_NEXT_LINEAR,
      layer_types=["linear_attention", "full_attention"],
      rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                       "partial_rotary_factor": 0.5})


_GEMMA4_LAYER_TYPES = ("sliding_attention", "full_attention") * 2
_GEMMA4_ROPE = {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                "factor": 2.0}


def _gemma4_config(**overrides) -> Any:
  """Sliding, full, twice (a pattern of two, scanned twice): global layers
  twice as wide with one key/value head whose k_proj gives the values,
  proportional RoPE on half of each head, a logit cap, 8-wide per-layer
  embeddings."""
  config = transformers.Gemma4TextConfig(
      **{**_DENSE, "num_hidden_layers": 4}, head_dim=16, global_head_dim=32,
      num_global_key_value_heads=1, attention_k_eq_v=True,
      hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
      sliding_window=WINDOW, max_position_embeddings=128,
      final_logit_softcapping=5.0, layer_types=list(_GEMMA4_LAYER_TYPES),
      rope_parameters={
          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
          "full_attention": {**_GEMMA4_ROPE, "rope_theta": 10000.0}},
      **overrides)
  config.architectures = ["Gemma4ForCausalLM"]
  return config


def _qwen3(tie: bool, **row) -> Family:
  return Family(
      arch="Qwen3ForCausalLM",
      hf_config=lambda: transformers.Qwen3Config(
          **_DENSE, head_dim=24, rms_norm_eps=1e-6, tie_word_embeddings=tie,
          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
      reads={"qk_norm": True, "qkv_bias": False, "head_dim": 24},
      batch=dict(length=11, pads=(0, 3, 8), seed=1),
      checks=frozenset({"prompt_decode", "qk_norm"}), **row)


FAMILIES = {
    # Tied embeddings, non-default theta, head_dim != hidden / heads.
    "llama": Family(
        arch="LlamaForCausalLM",
        hf_config=lambda: transformers.LlamaConfig(
            **_DENSE, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_theta=500.0, head_dim=8),
        reads={"qkv_bias": False, "tie_embeddings": True},
        weights=dict(scale=0.1)),
    # q/k/v biases, untied output head.
    "qwen2": Family(
        arch="Qwen2ForCausalLM",
        hf_config=lambda: transformers.Qwen2Config(
            **_DENSE, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_theta=10000.0),
        reads={"qkv_bias": True, "tie_embeddings": False},
        weights=dict(scale=0.1),
        checks=frozenset({"malformed_checkpoints"})),
    # Per-head q/k RMSNorm, explicit head_dim, no biases.
    "qwen3_tied": _qwen3(True),
    "qwen3_untied": _qwen3(
        False, tiny=dict(qk_norm=True),
        export_refusals=((None, "LlamaForCausalLM", "export as Qwen3"),
                         ({}, "Qwen3ForCausalLM", "Qwen3ForCausalLM")),
        import_refusals=(({"attention_bias": True}, "attention_bias"),
                         ({"use_sliding_window": True},
                          "use_sliding_window"))),
    # A sliding window (4) shorter than every test sequence.
    "mistral": Family(
        arch="MistralForCausalLM",
        hf_config=lambda: transformers.MistralConfig(
            **_DENSE, head_dim=16, rms_norm_eps=1e-5, sliding_window=WINDOW,
            max_position_embeddings=128, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        reads={"sliding_window": WINDOW, "qkv_bias": False},
        batch=dict(length=11, pads=(0, 3, 5), seed=1),
        layouts=ALL_LAYOUTS, saved={"sliding_window": WINDOW},
        checks=frozenset({"sliding_window", "packed_rows", "batch_decode"}),
        tiny=dict(sliding_window=8),
        export_refusals=((None, "LlamaForCausalLM", "export as Mistral"),
                         ({"qkv_bias": True}, "MistralForCausalLM",
                          "qkv_bias")),
        import_refusals=(({"layer_types": ["sliding_attention",
                                           "full_attention"]},
                          "layer_types"),)),
    # Sliding and full layers interleaved, their own RoPE bases, linear RoPE
    # scaling on the full layers, query_pre_attn_scalar != head_dim; its
    # (1 + w) norms init to 0, so they are perturbed like any weight.
    "gemma3": Family(
        arch="Gemma3ForCausalLM",
        hf_config=_gemma3_config,
        reads={"sliding_window": WINDOW, "qk_norm": True,
               "layer_types": _GEMMA3_LAYER_TYPES, "tie_embeddings": True,
               "local_rope_theta": 100.0, "rope_theta": 10000.0},
        batch=dict(length=11, pads=(0, 3, 5), seed=1),
        weights=dict(norm_center=None),
        layouts=ALL_LAYOUTS, saved={"sliding_window": WINDOW},
        checks=frozenset({"sliding_window", "packed_rows", "batch_decode"}),
        tiny=dict(num_layers=3, sliding_window=8, qk_norm=True,
                  tie_embeddings=True,
                  layer_types=("sliding_attention",) * 2 + ("full_attention",),
                  local_rope_theta=10000.0, query_pre_attn_scalar=32.0,
                  norm_style="gemma", mlp_activation="gelu_tanh"),
        export_refusals=((None, "LlamaForCausalLM", "export as Gemma3"),
                         ({}, "Gemma3ForCausalLM", "Gemma3ForCausalLM needs")),
        import_refusals=(({"final_logit_softcapping": 30.0}, "softcapping"),)),
    # Fused qkv_proj and gate_up_proj, partial rotary, LongRoPE, a window.
    "phi3": Family(
        atol=1e-5,
        arch="Phi3ForCausalLM",
        hf_config=_phi3_config,
        reads={"rotary_dim": 8, "sliding_window": WINDOW,
               "tie_embeddings": False},
        batch=dict(length=11, pads=(0, 3, 5), seed=1),
        weights=dict(scale=0.1), layouts=("default", "unrolled-blockwise"),
        saved={"sliding_window": WINDOW, "original_max_position_embeddings": 64},
        checks=frozenset({"sliding_window", "batch_decode"}),
        tiny=dict(rotary_dim=8, sliding_window=8),
        export_refusals=((None, "LlamaForCausalLM", "export as Phi3"),
                         ({"rotary_dim": 8, "qk_norm": True},
                          "Phi3ForCausalLM", "qk_norm")),
        import_refusals=(({"rope_parameters": {
            "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                          "Phi3Config takes only"),
                         ({"attention_bias": True}, "attention_bias"))),
    # A NoPE layer (the second: no_rope_layer_interval 2) after a RoPE one.
    "smollm3": Family(
        atol=1e-5,
        arch="SmolLM3ForCausalLM",
        hf_config=lambda: transformers.SmolLM3Config(
            **_DENSE, head_dim=16, rms_norm_eps=1e-6, pad_token_id=0,
            no_rope_layer_interval=2, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
        reads={"nope_layers": (1,), "tie_embeddings": True},
        batch=dict(length=11, pads=(0, 3, 8), seed=1),
        weights=dict(scale=0.1), layouts=("default", "unrolled-dense"),
        checks=frozenset({"prompt_decode", "nope_layers"}),
        tiny=dict(nope_layers=(1,)),
        export_refusals=((None, "LlamaForCausalLM", "export as SmolLM3"),),
        import_refusals=(({"use_sliding_window": True}, "use_sliding_window"),
                         ({"no_rope_layers": [1]}, "each of the 2 layers"))),
    # Post-norm blocks (no pre-norms), q/k norms over all heads at once.
    "olmo2": Family(
        atol=1e-5,
        arch="Olmo2ForCausalLM",
        hf_config=lambda: transformers.Olmo2Config(
            **_DENSE, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        reads={"norm_style": "olmo", "qk_norm": True,
               "qk_norm_full_width": True, "head_dim": 16},
        batch=dict(length=11, pads=(0, 3, 8), seed=1),
        weights=dict(scale=0.1),
        # Decoding through the cache: OLMo 3's row (the same blocks).
        checks=frozenset({"qk_norm"}),
        tiny=dict(norm_style="olmo", qk_norm=True, qk_norm_full_width=True),
        export_refusals=((None, "LlamaForCausalLM", "export as Olmo2"),
                         (None, "Qwen3ForCausalLM", "qk_norm_full_width"),
                         ({"qk_norm": True}, "Olmo2ForCausalLM",
                          "export as Qwen3")),
        import_refusals=(({"attention_bias": True}, "attention_bias"),)),
    # OLMo 2's blocks, a sliding layer and a full one with their own RoPE.
    "olmo3": Family(
        atol=1e-5,
        arch="Olmo3ForCausalLM",
        hf_config=_olmo3_config,
        reads={"norm_style": "olmo", "qk_norm_full_width": True,
               "sliding_window": WINDOW, "local_rope_theta": 100.0,
               "layer_types": ("sliding_attention", "full_attention"),
               "head_dim": 16},
        batch=dict(length=11, pads=(0, 3, 5), seed=1),
        weights=dict(scale=0.1), layouts=("default", "unrolled-blockwise"),
        saved={"sliding_window": WINDOW},
        checks=frozenset({"sliding_window", "batch_decode", "qk_norm"}),
        tiny=dict(norm_style="olmo", qk_norm=True, qk_norm_full_width=True,
                  sliding_window=8, local_rope_theta=100.0,
                  layer_types=("sliding_attention", "full_attention")),
        export_refusals=((None, "Olmo2ForCausalLM", "export as Olmo3"),
                         (None, "Gemma3ForCausalLM", "Gemma3ForCausalLM needs")),
        import_refusals=(({"rope_parameters": {
            "sliding_attention": {"rope_type": "linear", "factor": 2.0},
            "full_attention": {"rope_type": "default"}}},
                          "sliding-layer RoPE scaling"),)),
    # Softmax top-k with renormalised weights, q/k norms, a dense first layer
    # (mlp_only_layers), untied head.
    "qwen3_moe": Family(
        arch="Qwen3MoeForCausalLM",
        hf_config=lambda: transformers.Qwen3MoeConfig(
            **_MOE, num_experts=8, mlp_only_layers=[0], decoder_sparse_step=1,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
        reads={"moe.num_experts": 8, "first_dense_layers": 1,
               "num_moe_layers": 2, "qk_norm": True, "rotary_dim": 0,
               "moe.router": "softmax"},
        batch=dict(vocab=96), weights=dict(buffers=True),
        checks=frozenset({"moe"}), marks=(pytest.mark.slow,)),
    # Every GLM-4.5 routing feature: one dense layer first, grouped sigmoid
    # routing with a score-correction bias, routed scaling, a shared expert,
    # q/k/v biases, q/k norms and partial rotary.
    "glm4_moe": Family(
        arch="Glm4MoeForCausalLM",
        hf_config=lambda: transformers.Glm4MoeConfig(
            **_MOE, n_routed_experts=8, n_group=2, topk_group=1,
            n_shared_experts=1, routed_scaling_factor=1.5,
            first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                             "partial_rotary_factor": 0.5}),
        reads={"moe.num_experts": 8, "first_dense_layers": 1,
               "num_moe_layers": 2, "qk_norm": True, "rotary_dim": 4,
               "moe.router": "sigmoid"},
        batch=dict(vocab=96), weights=dict(buffers=True),
        checks=frozenset({"moe"}), marks=(pytest.mark.slow,)),
    # Multi-head latent attention (the KV cache holds the latent) over
    # GLM-4.5's routing; the tiny config has no query bottleneck.
    "deepseek_v3": Family(
        atol=1e-5,
        arch="DeepseekV3ForCausalLM",
        hf_config=_deepseek_v3_config,
        reads={"moe.num_experts": 8, "first_dense_layers": 1,
               "num_moe_layers": 2, "kv_lora_rank": 16, "q_lora_rank": 24,
               "head_dim": 24, "num_kv_heads": 4, "moe.router": "sigmoid"},
        weights=dict(buffers=True),
        layouts=("default", "unrolled-blockwise"),
        checks=frozenset({"moe", "prompt_decode"}),
        tiny=dict(num_heads=4, num_kv_heads=4, head_dim=24, **_MLA,
                  first_dense_layers=1, moe=MoeConfig(
                      num_experts=4, top_k=2, intermediate_size=16,
                      router="sigmoid", n_shared_experts=1)),
        export_refusals=((None, "Glm4MoeForCausalLM", "kv_lora_rank"),),
        import_refusals=(({"rope_interleave": False}, "rope_interleave"),
                         ({"num_key_value_heads": 2}, "num_key_value_heads")),
        marks=(pytest.mark.slow,)),
    # Qwen3.5's hybrid decoder: Gated DeltaNet layers (grouped value heads,
    # a short conv) between gated full-attention layers with partial
    # rotary and q/k norms; (1 + w) norms init to 0, perturbed like any
    # weight.
    "qwen3_5": Family(
        atol=5e-5,  # Measured 1.5e-5 (the delta rule's float32 sums).
        arch="Qwen3_5ForCausalLM",
        hf_config=_qwen3_5_config,
        reads={"layer_types": _QWEN3_5_LAYER_TYPES, "attn_output_gate": True,
               "norm_style": "qwen3_5", "rotary_dim": 4, "qk_norm": True,
               "head_dim": 16, **_QWEN3_5_LINEAR},
        batch=dict(length=11, pads=(0, 3, 8), seed=1),
        weights=dict(norm_center=None),
        layouts=("default", "unrolled-dense"),
        saved={"layer_types": list(_QWEN3_5_LAYER_TYPES)},
        checks=frozenset({"batch_decode"}),
        tiny=dict(layer_types=("linear_attention", "full_attention"),
                  norm_style="qwen3_5", qk_norm=True, attn_output_gate=True,
                  rotary_dim=4, **_QWEN3_5_LINEAR),
        export_refusals=((None, "LlamaForCausalLM", "Qwen3.5"),
                         (None, "Qwen3ForCausalLM", "attn_output_gate"),
                         ({"qk_norm": True}, "Qwen3_5ForCausalLM",
                          "Qwen3_5ForCausalLM cannot express")),
        import_refusals=(({"attention_bias": True}, "attention_bias"),
                         ({"layer_types": ["linear_attention",
                                           "sliding_attention"]},
                          "layer_types"))),
    # Qwen3-Next: Qwen3.5's hybrid decoder (its linear layers' input
    # projections fused per key head) over softmax-routed experts and a
    # shared expert scaled by a sigmoid gate.
    "qwen3_next": Family(
        atol=2e-5,  # Measured 3.7e-6.
        arch="Qwen3NextForCausalLM",
        hf_config=_qwen3_next_config,
        reads={"layer_types": ("linear_attention", "full_attention"),
               "attn_output_gate": True, "norm_style": "qwen3_5",
               "rotary_dim": 4, "moe.num_experts": 8, "moe.router": "softmax",
               "moe.n_shared_experts": 1, "moe.shared_intermediate_size": 24,
               "moe.shared_expert_gate": True, "num_moe_layers": 2,
               **_QWEN3_NEXT_LINEAR},
        batch=dict(vocab=96), weights=dict(norm_center=None),
        layouts=("default", "unrolled-dense"),
        checks=frozenset({"moe", "batch_decode"}),
        tiny=dict(layer_types=("linear_attention", "full_attention"),
                  norm_style="qwen3_5", qk_norm=True, attn_output_gate=True,
                  rotary_dim=4, **_QWEN3_NEXT_LINEAR, moe=MoeConfig(
                      num_experts=4, top_k=2, intermediate_size=16,
                      n_shared_experts=1, shared_intermediate_size=24,
                      shared_expert_gate=True)),
        export_refusals=((None, "Qwen3_5ForCausalLM", "moe"),
                         (None, "Qwen3MoeForCausalLM", "norm_style"),
                         ({"layer_types": ("linear_attention",
                                           "full_attention"),
                           "norm_style": "qwen3_5", "qk_norm": True,
                           "attn_output_gate": True, **_QWEN3_NEXT_LINEAR,
                           "moe": MoeConfig(num_experts=4, top_k=2,
                                            intermediate_size=16)},
                          "Qwen3NextForCausalLM", "one gated shared")),
        import_refusals=(({"mlp_only_layers": [1]}, "mlp_only_layers"),
                         ({"num_experts": 0}, "Qwen3_5ForCausalLM's"),
                         ({"attention_bias": True}, "attention_bias")),
        marks=(pytest.mark.slow,)),
    # Gemma 4: Gemma 3's layers with w (not 1 + w) norms, a value norm,
    # unscaled scores, per-layer output scalars (buffers, perturbed about
    # 1), per-layer embeddings and global layers of their own shape
    # (scanned as a layer pattern).
    "gemma4": Family(
        atol=3e-5,  # Measured 1.1e-5 (unrolled-blockwise).
        arch="Gemma4ForCausalLM",
        hf_config=_gemma4_config,
        reads={"norm_style": "gemma4", "layer_types": _GEMMA4_LAYER_TYPES,
               "global_head_dim": 32, "global_kv_heads": 1,
               "attention_k_eq_v": True, "final_logit_softcapping": 5.0,
               "sliding_window": WINDOW, "local_rope_theta": 100.0,
               "query_pre_attn_scalar": 1.0, "grouped": True,
               "per_layer_input_size": 8, "kv_shared_layers": 0,
               "rope_scaling": tuple(sorted(_GEMMA4_ROPE.items()))},
        batch=dict(length=11, pads=(0, 3, 5), seed=1),
        weights=dict(scale=0.1, buffers=("layer_scalar",)),
        layouts=("default", "unrolled-blockwise"),
        saved={"sliding_window": WINDOW, "attention_k_eq_v": True,
               "hidden_size_per_layer_input": 8},
        checks=frozenset({"sliding_window", "batch_decode"}),
        tiny=dict(layer_types=("sliding_attention", "full_attention"),
                  sliding_window=8, qk_norm=True, tie_embeddings=True,
                  local_rope_theta=100.0, query_pre_attn_scalar=1.0,
                  norm_style="gemma4", mlp_activation="gelu_tanh",
                  global_head_dim=32, global_kv_heads=1,
                  attention_k_eq_v=True, final_logit_softcapping=30.0,
                  per_layer_input_size=8,
                  rope_scaling={"rope_type": "proportional",
                                "partial_rotary_factor": 0.25}),
        export_refusals=((None, "Gemma3ForCausalLM", "Gemma3ForCausalLM needs"),
                         (None, "LlamaForCausalLM", "export as Gemma4"),
                         ({"norm_style": "gemma4"}, "Gemma4ForCausalLM",
                          "layer_types ending in a full layer")),
        import_refusals=(({"vocab_size_per_layer_input": 64},
                          "vocab_size_per_layer_input"),
                         ({"enable_moe_block": True}, "enable_moe_block"),
                         ({"per_layer_config": {"0": {"head_dim": 32}}},
                          "per_layer_config"))),
    # E2B / E4B's layout: the last two layers attend with the keys and
    # values of the last earlier layer of their kind (no k/v of their own;
    # the whole model one scanned repeat), their MLPs twice as wide.
    "gemma4_shared_kv": Family(
        atol=3e-5,  # Measured 5.3e-6.
        arch="Gemma4ForCausalLM",
        hf_config=lambda: _gemma4_config(num_kv_shared_layers=2,
                                         use_double_wide_mlp=True),
        reads={"kv_shared_layers": 2, "double_wide_mlp": True,
               "per_layer_input_size": 8, "grouped": True},
        batch=dict(length=11, pads=(0, 3, 5), seed=1),
        weights=dict(scale=0.1, buffers=("layer_scalar",)),
        saved={"num_kv_shared_layers": 2, "use_double_wide_mlp": True},
        checks=frozenset({"batch_decode"})),
}


def _rows(check: str | None = None,
          variants: Callable[[Family], tuple[str, ...]] | None = None
          ) -> list[Any]:
  """pytest params of each row naming `check` (all rows: None): its name,
  and with `variants` one param per (name, variant)."""
  assert check is None or check in CHECKS, check
  params = []
  for name, family in FAMILIES.items():
    if check is not None and check not in family.checks:
      continue
    if variants is None:
      params.append(pytest.param(name, id=name, marks=family.marks))
    else:
      params.extend(pytest.param(name, v, id=f"{name}-{v}", marks=family.marks)
                    for v in variants(family))
  return params


@dataclasses.dataclass(frozen=True)
class Reference:
  """A row's saved random checkpoint, its transformers model, test batch
  (tokens, mask, positions) and transformers' logits on that batch."""
  family: Family
  path: pathlib.Path
  model: Any
  batch: tuple[np.ndarray, np.ndarray, np.ndarray]
  want: np.ndarray


@pytest.fixture(scope="module")
def built() -> dict[str, Reference]:
  """The references built so far in this module, by row name."""
  return {}


@pytest.fixture
def reference(request, built, tmp_path_factory) -> Reference:
  """The row's Reference, built once per module whatever the test order."""
  name = request.param
  if name not in built:
    family = FAMILIES[name]
    path = tmp_path_factory.mktemp(name) / "hf"
    model = hf_reference.save_random_model(
        getattr(transformers, family.arch), family.hf_config(), path,
        **family.weights)
    batch = hf_reference.left_padded_batch(**family.batch)
    built[name] = Reference(family, path, model, batch,
                            hf_reference.hf_logits(model, *batch))
  return built[name]


def _in_layout(config: ModelConfig, layout: str) -> ModelConfig:
  if layout == "default":
    return config
  return dataclasses.replace(config, attention=LAYOUTS[layout][1],
                             attention_block_q=3, attention_block_kv=2)


def _load(path: pathlib.Path, layout: str) -> tuple[ModelConfig, Any]:
  if layout == "default":
    return hf.load_hf_checkpoint(path)
  return hf.load_hf_checkpoint(path, scan_layers=LAYOUTS[layout][0])


def _attribute(config: ModelConfig, dotted: str) -> Any:
  value = config
  for name in dotted.split("."):
    value = getattr(value, name)
  return value


def _attention_params(params: Any,
                      path_is_attention: Callable[[Any], bool]) -> int:
  return sum(x.size for k, x in jax.tree_util.tree_leaves_with_path(params)
             if path_is_attention(k))


def test_every_supported_architecture_has_a_row():
  assert {f.arch for f in FAMILIES.values()} == set(SUPPORTED_ARCHITECTURES)
  for family in FAMILIES.values():
    assert family.checks <= set(CHECKS)
    assert set(family.layouts) <= set(LAYOUTS)


# --------------------------------------------------- every row ---------------


@pytest.mark.parametrize("reference,layout", _rows(None, lambda f: f.layouts),
                         indirect=["reference"])
def test_logits_match_transformers(reference, layout):
  """The import reads the row's config, counts its parameters, and gives
  transformers' logits on the left-padded batch."""
  family, want = reference.family, reference.want
  config, params = _load(reference.path, layout)
  for name, value in family.reads.items():
    assert _attribute(config, name) == value, name
  assert config.hf_architecture() == family.arch
  assert sum(x.size for x in jax.tree.leaves(params)) == config.num_params()
  assert _attention_params(params, optim.path_is_attention) == (
      memory.attention_params(config))
  tokens, mask, positions = reference.batch
  got = hf_reference.our_logits(_in_layout(config, layout), params, tokens,
                                mask, positions)
  assert np.abs(got[mask] - want[mask]).max() <= family.atol
  assert np.abs(want[mask]).max() > 0.1  # Real logits, not near zero.


@pytest.mark.parametrize("reference", _rows(), indirect=True)
def test_export_reloads_in_transformers(reference, tmp_path):
  """Export: tensor for tensor what transformers saved; transformers loads
  it as the same architecture with the same logits; the config reads back."""
  family, want = reference.family, reference.want
  config, params = hf.load_hf_checkpoint(reference.path)
  assert config.hf_architecture() == family.arch
  hf.save_hf_checkpoint(config, params, tmp_path, arch=family.arch)
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["architectures"] == [family.arch]
  for name, value in family.saved.items():
    assert saved[name] == value, name
  assert ModelConfig.from_hf_config(saved) == config
  theirs = safetensors_numpy.load_file(
      os.path.join(reference.path, "model.safetensors"))
  ours = safetensors_numpy.load_file(
      os.path.join(tmp_path, "model.safetensors"))
  assert sorted(ours) == sorted(theirs)
  for name in theirs:
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == family.arch
  tokens, mask, positions = reference.batch
  got = hf_reference.hf_logits(reloaded, tokens, mask, positions)
  ref = hf_reference.our_logits(config, params, tokens, mask, positions)
  assert np.abs(got[mask] - ref[mask]).max() <= 1e-4
  assert np.abs(got[mask] - want[mask]).max() <= 1e-4


@pytest.mark.parametrize("reference", _rows(), indirect=True)
def test_sharded_checkpoint_bf16_and_shardings(reference, tmp_path):
  """A bfloat16 checkpoint in several files loads onto a mesh, upcast."""
  _, ref_params = hf.load_hf_checkpoint(reference.path)
  # Sharded (index.json + several files), stored in bfloat16.
  copy.deepcopy(reference.model).to(torch.bfloat16).save_pretrained(
      tmp_path, max_shard_size="40KB")
  assert os.path.isfile(tmp_path / "model.safetensors.index.json")
  assert len(list(tmp_path.glob("*.safetensors"))) > 1
  # Place every tensor on a mesh, with shardings from the logical axis names.
  config = ModelConfig.from_hf_config(json.loads(
      (tmp_path / "config.json").read_text()))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  tok = jnp.zeros((1, 2), jnp.int32)
  abstract = jax.eval_shape(tm.Transformer(config).init, jax.random.key(0), tok,
                            tok, tok > 0)
  shardings = nn.logical_to_mesh_sharding(
      nn.get_partition_spec(abstract), mesh, [("embed", "fsdp")])["params"]
  config, params = hf.load_hf_checkpoint(tmp_path, shardings=shardings)
  emb = params["decoder"]["embedder"]["embedding"]
  assert emb.sharding == jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(None, "fsdp"))
  assert emb.dtype == jnp.float32
  # bf16 values upcast exactly: equal to the float32 weights rounded to bf16.
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
    np.testing.assert_array_equal(
        np.asarray(a), np.asarray(b).astype(jnp.bfloat16).astype(np.float32))
  _, bf = hf.load_hf_checkpoint(tmp_path, param_dtype="bfloat16")
  assert bf["decoder"]["final_norm"]["scale"].dtype == jnp.bfloat16


@pytest.mark.parametrize(
    "name", [n for n, f in FAMILIES.items() if f.tiny is not None])
def test_tiny_config_converts_and_refuses(name):
  """A tiny config of the family round-trips through its HF config; the
  exports and imports it cannot express are refused."""
  family = FAMILIES[name]
  cfg = ModelConfig.tiny(**family.tiny)
  assert cfg.hf_architecture() == family.arch
  hf_cfg = cfg.to_hf_config(family.arch)
  assert hf_cfg["architectures"] == [family.arch]
  assert ModelConfig.from_hf_config(hf_cfg) == cfg
  for tiny, arch, words in family.export_refusals:
    other = cfg if tiny is None else ModelConfig.tiny(**tiny)
    with pytest.raises(UnsupportedConfigError, match=words):
      other.to_hf_config(arch)
  for items, words in family.import_refusals:
    with pytest.raises(UnsupportedConfigError, match=words):
      ModelConfig.from_hf_config(hf_cfg | items)


# ------------------------------- sliding windows, NoPE layers --------------

# A feature's CHECKS name -> the ModelConfig field that turns it off.
_FEATURE_OFF = {"sliding_window": ("sliding_window", 0),
                "nope_layers": ("nope_layers", ())}


def _feature_rows() -> list[Any]:
  return [pytest.param(feature, *p.values, id=f"{feature}-{p.id}",
                       marks=p.marks)
          for feature in _FEATURE_OFF
          for p in _rows(feature, lambda f: f.layouts)]


@pytest.mark.parametrize("feature,reference,layout", _feature_rows(),
                         indirect=["reference"])
def test_feature_applies(feature, reference, layout):
  """With the feature off (no window; RoPE in every layer) the logits differ
  from transformers'."""
  config, params = _load(reference.path, layout)
  tokens, mask, positions = reference.batch
  field, off = _FEATURE_OFF[feature]
  without = hf_reference.our_logits(
      dataclasses.replace(_in_layout(config, layout), **{field: off}),
      params, tokens, mask, positions)
  assert np.abs(without[mask] - reference.want[mask]).max() > 1e-2


@pytest.mark.parametrize("reference,attn",
                         _rows("packed_rows", lambda f: ("dense", "blockwise")),
                         indirect=["reference"])
def test_packed_row_equals_trajectories_alone(reference, attn):
  hf_reference.check_packed_row_equals_trajectories_alone(
      reference.path, reference.model, attn)


@pytest.mark.parametrize("reference", _rows("batch_decode"), indirect=True)
def test_greedy_continuation_through_the_kv_cache(reference):
  """32 greedy tokens per prompt of the left-padded batch (far past any
  window) equal HF `generate`; the recorded log-probs equal the trainer's
  full forward."""
  tokens, mask, _ = reference.batch
  hf_reference.check_greedy_continuation(reference.path, reference.model,
                                         tokens, mask, NEW_TOKENS)


def test_mistral_without_a_window_reads_and_writes_none():
  cfg = ModelConfig.tiny(**FAMILIES["mistral"].tiny)
  hf_cfg = cfg.to_hf_config(cfg.hf_architecture())
  no_window = ModelConfig.from_hf_config(hf_cfg | {"sliding_window": None})
  assert no_window.sliding_window == 0
  assert no_window.to_hf_config("MistralForCausalLM")["sliding_window"] is None


def test_qwen3_5_layer_groups_cache_refill_and_packed_rows():
  """A hybrid decoder's scanned params: one [G, ...] stack per member of its
  layer pattern; its cache holds KV for the attention layers only and
  (state, conv states) for the linear ones; packed rows are refused (the
  state would run across trajectories), not run wrong."""
  tiny = FAMILIES["qwen3_5"].tiny
  cfg = ModelConfig.tiny(**{**tiny, "num_layers": 6,
                            "layer_types": tiny["layer_types"] * 3})
  assert cfg.layer_pattern() == 2
  tok = jnp.zeros((2, 5), jnp.int32)
  model = tm.Transformer(cfg)
  params = jax.eval_shape(model.init, jax.random.key(0), tok, tok,
                          tok >= 0)["params"]
  groups = params["decoder"]["layer_groups"]
  assert sorted(groups) == ["full_1", "linear_0"]
  assert nn.unbox(groups["linear_0"]["linear_attn"]["q_proj"]).shape == (
      3, 64, 2, 16)
  assert nn.unbox(groups["full_1"]["attn"]["q_proj"]).shape == (3, 64, 4, 32)
  assert sum(x.size for x in jax.tree.leaves(nn.unbox(params))) == (
      cfg.num_params())
  cache = tm.init_cache(cfg, 2, 8)
  assert cache.k.shape == (3, 2, 8, 2, 16)
  assert [a.shape for a in cache.linear] == [
      (3, 2, 4, 16, 8), (3, 2, 32, 3), (3, 2, 32, 3), (3, 2, 32, 3)]
  _, new = jax.eval_shape(model.apply, {"params": params}, tok, tok,
                          tok >= 0, cache)
  assert jax.tree.map(lambda a: a.shape, new) == jax.tree.map(
      lambda a: a.shape, cache)
  state_bytes = sum(a.size * a.dtype.itemsize for a in cache.linear)
  assert memory.estimate_memory(cfg, kv_batch=2, kv_len=8).kv_cache == (
      cache.k.nbytes + cache.v.nbytes + state_bytes)
  # A refilled slot starts from a zero state; the other rows keep theirs.
  state = decoding.init_state(cfg, 2, 8)
  filled = jax.tree.map(jnp.ones_like, state.cache.linear)
  state = decoding.clear_rows(
      state.replace(cache=state.cache.replace(linear=filled)),
      jnp.array([True, False]))
  for a in state.cache.linear:
    assert not np.asarray(a[:, 0]).any() and np.asarray(a[:, 1]).all()
  with pytest.raises(NotImplementedError, match="packed rows"):
    jax.eval_shape(model.apply, {"params": params}, tok, tok, tok >= 0,
                   segment_ids=jnp.ones_like(tok))


@pytest.mark.parametrize("reference", ["qwen3_5"], indirect=True)
def test_qwen3_5_right_padded_chunks_equal_one_pass(reference):
  """Two right-padded chunks through the sampler's cache (rows of other
  lengths: padding mid-sequence must neither decay nor write a linear
  layer's state, nor enter its conv state) give each row's full-forward
  logits after its last token."""
  config, params = hf.load_hf_checkpoint(reference.path)
  toks = np.random.default_rng(0).integers(1, 128, (2, 14)).astype(np.int32)
  state = decoding.init_state(config, 2, 32)
  start = np.zeros(2, int)
  for lengths in ((9, 4), (5, 10)):
    chunk, mask = np.zeros((2, 10), np.int32), np.zeros((2, 10), bool)
    for r, n in enumerate(lengths):
      chunk[r, :n], mask[r, :n] = toks[r, start[r]:start[r] + n], True
    start += lengths
    state, _ = decoding.append_chunk(params, config, state,
                                     jnp.asarray(chunk), jnp.asarray(mask))
  want = hf_reference.our_logits(config, params, toks, np.ones_like(toks, bool),
                                 np.tile(np.arange(14, dtype=np.int32), (2, 1)))
  assert np.abs(np.asarray(state.last_logits) - want[:, -1]).max() <= 2e-5


def test_gemma3_layer_types_must_name_every_layer():
  with pytest.raises(ValueError, match="layer_types"):
    ModelConfig.tiny(layer_types=("full_attention",))


# ------------------------------------------ decoding, prompt by prompt -------


@pytest.mark.parametrize("reference", _rows("prompt_decode"), indirect=True)
def test_sampler_decode_matches_transformers(reference):
  """Greedy 32 tokens = HF generate; sampler log-probs = full forward."""
  path = reference.path
  config, params = hf.load_hf_checkpoint(path)
  decode_parity.check_greedy_matches_generate(
      config, params, lambda: transformers.AutoModelForCausalLM.from_pretrained(
          path, attn_implementation="eager").eval(), torch)
  decode_parity.check_sampler_logprobs_equal_full_forward(config, params)


# ------------------------------------------------------ q/k norms ------------


@pytest.mark.parametrize("reference", _rows("qk_norm"), indirect=True)
def test_qk_norms_are_attention_params_and_applied(reference):
  config, params = hf.load_hf_checkpoint(reference.path)
  attn = params["decoder"]["layers"]["attn"]  # Stacked: [L, ...] leaves.
  heads = ((config.num_heads,), (config.num_kv_heads,)) if (
      config.qk_norm_full_width) else ((), ())  # OLMo: all heads at once.
  for name, n in zip(("q_norm", "k_norm"), heads):
    assert attn[name]["scale"].shape == (
        config.num_layers, *n, reference.family.reads["head_dim"])
  # The q/k norms are attention parameters (frozen with the attention).
  assert _attention_params(
      params, lambda k: "attn" in jax.tree_util.keystr(k)) == (
          memory.attention_params(config))
  # Without the q/k norms the logits differ: they are really applied.
  layers = {"layers": dict(params["decoder"]["layers"])}
  for layer in layers.values():
    layer["attn"] = {k: v for k, v in layer["attn"].items()
                     if not k.endswith("_norm")}
  tokens, mask, positions = reference.batch
  plain = hf_reference.our_logits(
      dataclasses.replace(config, qk_norm=False, qk_norm_full_width=False),
      {**params, "decoder": {**params["decoder"], **layers}},
      tokens, mask, positions)
  assert np.abs(plain[mask] - reference.want[mask]).max() > 1e-2


# ------------------------------------------------- mixture of experts --------


def _logits_and_routing(config: ModelConfig, params: Any, tokens: np.ndarray,
                        mask: np.ndarray, positions: np.ndarray,
                        routing: Any = None) -> tuple[np.ndarray, Any]:
  """Our logits and the MoE layers' outputs (experts, aux_loss, ...)."""

  @jax.jit
  def forward(params, tokens, positions, mask, routing):
    (logits, _), state = tm.Transformer(config).apply(
        {"params": params}, tokens, positions, mask, routing=routing,
        mutable=["moe"])
    return logits, tm.moe_outputs(state)
  logits, moe = forward(params, jnp.asarray(tokens), jnp.asarray(positions),
                        jnp.asarray(mask), routing)
  return np.asarray(logits), moe


@pytest.mark.parametrize("reference", _rows("moe"), indirect=True)
def test_moe_routing_is_recorded(reference):
  config, params = hf.load_hf_checkpoint(reference.path)
  # The experts' stacks (one, or a hybrid decoder's one per pattern member).
  stacks = [x.shape for k, x in jax.tree_util.tree_leaves_with_path(params)
            if jax.tree_util.keystr(k).endswith("['moe']['gate_proj']")]
  assert sum(s[0] for s in stacks) == 2
  assert {s[1:] for s in stacks} == {(8, 32, 16)}
  tokens, mask, positions = reference.batch
  got, moe = _logits_and_routing(config, params, tokens, mask, positions)
  want = reference.want
  assert np.abs(got[mask] - want[mask]).max() <= 1e-4
  assert np.abs(want[mask]).max() > 0.1
  experts = np.asarray(moe["experts"])
  assert experts.shape == (3, 10, 2, 2)  # [B, T, M, k]
  assert float(moe["aux_loss"]) > 0


@pytest.mark.parametrize("reference", _rows("moe"), indirect=True)
def test_moe_unrolled_layout_matches_scanned(reference):
  config, params = hf.load_hf_checkpoint(reference.path)
  flat_cfg, flat = hf.load_hf_checkpoint(reference.path, scan_layers=False)
  tokens, mask, positions = reference.batch
  scanned, m1 = _logits_and_routing(config, params, tokens, mask, positions)
  unrolled, m2 = _logits_and_routing(flat_cfg, flat, tokens, mask, positions)
  np.testing.assert_allclose(unrolled, scanned, atol=1e-5)
  np.testing.assert_array_equal(m1["experts"], m2["experts"])


@pytest.mark.parametrize("reference", _rows("moe"), indirect=True)
def test_moe_replay_reproduces_recorded_routing(reference):
  config, params = hf.load_hf_checkpoint(reference.path)
  tokens, mask, positions = reference.batch
  logits, moe = _logits_and_routing(config, params, tokens, mask, positions)
  recorded = moe["experts"]
  replayed, again = _logits_and_routing(config, params, tokens, mask,
                                        positions, routing=recorded)
  np.testing.assert_allclose(replayed, logits, atol=1e-6)
  np.testing.assert_array_equal(again["experts"], recorded)
  # Replaying other experts changes the function, and uses exactly those.
  other = (np.asarray(recorded) + 1) % 8
  changed, used = _logits_and_routing(config, params, tokens, mask, positions,
                                      routing=jnp.asarray(other))
  np.testing.assert_array_equal(used["experts"], other)
  # The router's own choice is still reported (the agreement metric): in
  # the first MoE layer it is the recorded one (later layers see hidden
  # states computed with the replayed experts).
  np.testing.assert_array_equal(used["own_experts"][:, :, 0],
                                np.asarray(recorded)[:, :, 0])
  assert np.abs(changed[mask] - logits[mask]).max() > 1e-3


@pytest.mark.parametrize("reference", _rows("moe"), indirect=True)
def test_moe_kv_cache_decode_matches_full_forward(reference):
  config, params = hf.load_hf_checkpoint(reference.path)
  tokens, mask, positions = reference.batch
  full, _ = _logits_and_routing(config, params, tokens, mask, positions)
  model = tm.Transformer(config)
  apply = jax.jit(model.apply)
  cache = tm.init_cache(config, 3, 12)
  pre, cache = apply({"params": params}, jnp.asarray(tokens[:, :7]),
                     jnp.asarray(positions[:, :7]), jnp.asarray(mask[:, :7]),
                     cache)
  outs = [pre]
  for t in range(7, 10):
    step, cache = apply(
        {"params": params}, jnp.asarray(tokens[:, t:t + 1]),
        jnp.asarray(positions[:, t:t + 1]), jnp.asarray(mask[:, t:t + 1]),
        cache)
    outs.append(step)
  got = np.concatenate([np.asarray(o) for o in outs], axis=1)
  assert np.abs(got[mask] - full[mask]).max() <= 1e-4


@pytest.mark.parametrize("reference", [pytest.param(
    "deepseek_v3", marks=pytest.mark.slow)], indirect=True)
def test_deepseek_v3_skips_mtp_layers_and_refuses_fp8(reference, tmp_path):
  """The multi-token-prediction layer after the decoder's is skipped; a
  quantized checkpoint (DeepSeek-V3's FP8) is refused, saying what to do."""
  mtp = _copy(reference.path, tmp_path / "mtp")
  name = "model.layers.3.eh_proj.weight"  # Layer 3 of 3: the MTP layer.
  _rewrite(mtp, lambda t: t.update({name: np.ones((32, 64), np.float32)}))
  cfg = json.loads((mtp / "config.json").read_text())
  (mtp / "config.json").write_text(
      json.dumps(cfg | {"num_nextn_predict_layers": 0}))
  with pytest.raises(hf.CheckpointError, match="layers.3.*not part"):
    hf.load_hf_checkpoint(mtp)
  (mtp / "config.json").write_text(
      json.dumps(cfg | {"num_nextn_predict_layers": 1}))
  _, params = hf.load_hf_checkpoint(mtp)
  _, want = hf.load_hf_checkpoint(reference.path)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
  (mtp / "config.json").write_text(json.dumps(cfg | {
      "quantization_config": {"quant_method": "fp8"}}))
  with pytest.raises(hf.CheckpointError, match="quantized.*'fp8'.*Dequantize"):
    hf.load_hf_checkpoint(mtp)


# ------------------------------------------------ malformed checkpoints ------


def _copy(path: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
  shutil.copytree(path, out)
  return out


def _rewrite(path: pathlib.Path,
             edit: Callable[[dict[str, np.ndarray]], Any]) -> None:
  file = os.path.join(path, "model.safetensors")
  tensors = safetensors_numpy.load_file(file)
  edit(tensors)
  safetensors_numpy.save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("reference", _rows("malformed_checkpoints"),
                         indirect=True)
def test_malformed_checkpoints(reference, tmp_path):
  path = reference.path
  name = "model.layers.1.self_attn.k_proj.bias"

  missing = _copy(path, tmp_path / "missing")
  _rewrite(missing, lambda t: t.pop(name))
  with pytest.raises(hf.CheckpointError, match=rf"'{name}' is missing"):
    hf.load_hf_checkpoint(missing)

  shape = _copy(path, tmp_path / "shape")
  _rewrite(shape, lambda t: t.update({name: np.zeros(16, np.float32)}))
  with pytest.raises(hf.CheckpointError) as e:
    hf.load_hf_checkpoint(shape)
  assert name in str(e.value) and "model.safetensors" in str(e.value)
  assert "(16,)" in str(e.value) and "(32,)" in str(e.value)

  extra = _copy(path, tmp_path / "extra")  # E.g. config of a 1-layer model.
  cfg = json.loads((extra / "config.json").read_text())
  (extra / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 1}))
  with pytest.raises(hf.CheckpointError, match=r"model\.layers\.1\..*not part"):
    hf.load_hf_checkpoint(extra)

  arch = _copy(path, tmp_path / "arch")
  (arch / "config.json").write_text(
      json.dumps(cfg | {"architectures": ["NoSuchLMForCausalLM"]}))
  with pytest.raises(hf.CheckpointError,
                     match=r"config\.json.*Unsupported architecture.*NoSuchLM"):
    hf.load_hf_checkpoint(arch)

  no_config = _copy(path, tmp_path / "no_config")
  os.remove(no_config / "config.json")
  with pytest.raises(hf.CheckpointError,
                     match=r"no_config/config\.json not found"):
    hf.load_hf_checkpoint(no_config)

  no_weights = _copy(path, tmp_path / "no_weights")
  os.remove(no_weights / "model.safetensors")
  with pytest.raises(hf.CheckpointError, match=r"No \*\.safetensors files"):
    hf.load_hf_checkpoint(no_weights)

  config, params = hf.load_hf_checkpoint(path)
  with pytest.raises(hf.CheckpointError, match="qkv_bias"):
    hf.save_hf_checkpoint(config, params, tmp_path / "out",
                          arch="LlamaForCausalLM")
