"""Hyper-parameters of the decoder LM (one family: Llama and Qwen2)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

# HF `architectures` entries we can read and write.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
# `ModelConfig.attention` values (layers/attention.choose).
ATTENTION_IMPLEMENTATIONS = ("auto", "dense", "blockwise", "cudnn", "splash")


# `ModelConfig.remat_policy` values (transformer.remat_policy maps them).
REMAT_POLICIES = ("none", "full", "dots_saveable",
                  "dots_with_no_batch_dims_saveable")
# Logical axis name of the stacked layer axis (scan_layers); the sharding
# rules map it to no mesh axis.
LAYERS_AXIS = "layers"


class UnsupportedConfigError(ValueError):
  """A HF config describes a model this decoder family cannot represent."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer: RMSNorm, RoPE, GQA, SwiGLU (Llama / Qwen2).

  Attributes:
    vocab_size: Number of token ids.
    hidden_size: Residual stream width ('embed').
    intermediate_size: SwiGLU hidden width ('mlp').
    num_layers: Number of decoder blocks.
    num_heads: Query heads ('heads').
    num_kv_heads: Key/value heads ('kv_heads'); must divide num_heads (GQA).
    head_dim: Per-head width ('head_dim').
    rope_theta: RoPE base frequency.
    rms_norm_eps: RMSNorm epsilon.
    qkv_bias: Bias on the q/k/v projections (Qwen2: True).
    tie_embeddings: Output projection = input embedding transposed.
    dtype: Compute dtype of activations (logits are always float32); e.g.
      'bfloat16' with float32 `param_dtype` (master weights and optimizer
      moments stay float32, matmuls run in bf16).
    param_dtype: Storage dtype of parameters.
    logits_chunk: Tokens per chunk of the trainer's log-probs and entropy
      (`sao_jax.models.logprobs.policy_token_stats`): the output head and
      log-softmax run on max(1, logits_chunk // B) positions of every row at
      a time, recomputed in the backward, so no [B, T, V] float32 array
      exists; 0 = full-vocab logits in one piece (the reference path). A run
      setting: the numbers are the same.
    attention: Attention core: 'auto' (per backend), 'dense' (reference),
      'blockwise' (plain JAX, no [T, S] array), 'cudnn' (GPU), 'splash'
      (TPU); layers/attention.choose, docs/DESIGN.md §5 "Attention".
    attention_block_q: Query block of the blockwise and splash paths.
    attention_block_kv: Key/value block of the blockwise path.
    scan_layers: Run the layers under `nn.scan` over parameters stacked on a
      leading 'layers' axis (one compiled layer body whatever the depth);
      False keeps one `layers_{i}` subtree per layer (the unrolled reference).
    remat_policy: What each decoder block keeps for the backward pass
      (`nn.remat`, one of REMAT_POLICIES): 'none' keeps everything, 'full'
      recomputes the block, 'dots_saveable' / 'dots_with_no_batch_dims_saveable'
      keep (some) matmul outputs.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  tie_embeddings: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  logits_chunk: int = 0
  attention: str = "auto"
  attention_block_q: int = 512
  attention_block_kv: int = 512
  scan_layers: bool = True
  remat_policy: str = "none"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
      )
    jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)  # Fail early on typos.
    if self.logits_chunk < 0:
      raise ValueError(f"logits_chunk={self.logits_chunk} must be >= 0 "
                       "(0: full-vocab logits).")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"attention={self.attention!r}; expected one of "
                       f"{ATTENTION_IMPLEMENTATIONS}.")
    if min(self.attention_block_q, self.attention_block_kv) < 1:
      raise ValueError(
          f"attention_block_q={self.attention_block_q} and attention_block_kv="
          f"{self.attention_block_kv} must be positive.")
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"remat_policy={self.remat_policy!r}; expected one of "
                       f"{REMAT_POLICIES}.")

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def params_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  def same_architecture(self, other: ModelConfig) -> bool:
    """Equal up to the run settings dtype, param_dtype, attention,
    logits_chunk, scan_layers and remat_policy."""
    run = dict(dtype="float32", param_dtype="float32", attention="auto",
               attention_block_q=512, attention_block_kv=512, logits_chunk=0,
               scan_layers=True, remat_policy="none")
    return (dataclasses.replace(self, **run) ==
            dataclasses.replace(other, **run))

  def num_params(self) -> int:
    """Exact number of parameters of the policy `Transformer`."""
    d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * dh * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += dh * (self.num_heads + 2 * self.num_kv_heads)
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_layers * layer + d + head

  @classmethod
  def tiny(cls, vocab_size: int = 128, **overrides) -> ModelConfig:
    """A few-layer model for tests and CPU smoke runs."""
    kw = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    )
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def from_hf_config(cls, hf: Mapping[str, Any]) -> ModelConfig:
    """Reads a HF `config.json` dict of a Llama or Qwen2 causal LM.

    Accepts both transformers 5 (`rope_parameters`) and 4 (`rope_theta`,
    `rope_scaling`) layouts. Raises UnsupportedConfigError for features this
    family does not implement (other architectures, rope scaling, biases on
    o_proj/MLP, sliding windows, non-SiLU activations).
    """
    archs = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    if archs:
      bad = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
      if bad:
        raise UnsupportedConfigError(
            f"Unsupported architecture {bad}; supported: "
            f"{list(SUPPORTED_ARCHITECTURES)}."
        )
      arch = archs[0]
    elif model_type in ("llama", "qwen2"):
      arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[
          model_type]
    else:
      raise UnsupportedConfigError(
          f"config has neither a supported `architectures` entry nor "
          f"model_type in ('llama', 'qwen2') (got architectures={archs}, "
          f"model_type={model_type!r})."
      )

    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise UnsupportedConfigError(
          f"hidden_act={act!r}; only 'silu' is supported.")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
      raise UnsupportedConfigError(
          f"rope_type={rope_type!r} (RoPE scaling) is not supported; only "
          "'default' RoPE is implemented."
      )
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))

    if arch == "LlamaForCausalLM":
      if hf.get("attention_bias", False):
        raise UnsupportedConfigError(
            "Llama attention_bias=True (bias on o_proj) is not supported.")
      if hf.get("mlp_bias", False):
        raise UnsupportedConfigError("Llama mlp_bias=True is not supported.")
      qkv_bias = False
    else:
      if hf.get("use_sliding_window", False):
        raise UnsupportedConfigError(
            "Qwen2 use_sliding_window=True is not supported.")
      qkv_bias = True

    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads,
        rope_theta=float(rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )

  def to_hf_config(self, arch: str = "LlamaForCausalLM") -> dict[str, Any]:
    """The HF `config.json` dict for `arch` (inverse of `from_hf_config`)."""
    if arch not in SUPPORTED_ARCHITECTURES:
      raise UnsupportedConfigError(
          f"Unsupported architecture {arch!r}; supported: "
          f"{list(SUPPORTED_ARCHITECTURES)}."
      )
    if arch == "LlamaForCausalLM" and self.qkv_bias:
      raise UnsupportedConfigError(
          "LlamaForCausalLM cannot express qkv_bias=True (its attention_bias "
          "also adds an o_proj bias); export as Qwen2ForCausalLM instead.")
    if arch == "Qwen2ForCausalLM" and not self.qkv_bias:
      raise UnsupportedConfigError(
          "Qwen2ForCausalLM always has q/k/v biases; this config has "
          "qkv_bias=False, export as LlamaForCausalLM instead.")
    cfg = {
        "architectures": [arch],
        "model_type": "llama" if arch == "LlamaForCausalLM" else "qwen2",
        "vocab_size": self.vocab_size,
        "hidden_size": self.hidden_size,
        "intermediate_size": self.intermediate_size,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": self.rms_norm_eps,
        "rope_theta": self.rope_theta,
        "rope_parameters": {"rope_type": "default",
                            "rope_theta": self.rope_theta},
        "tie_word_embeddings": self.tie_embeddings,
        "torch_dtype": self.param_dtype,
        "dtype": self.param_dtype,
    }
    if arch == "LlamaForCausalLM":
      cfg.update(attention_bias=False, mlp_bias=False)
    else:
      cfg.update(use_sliding_window=False)
    return cfg
