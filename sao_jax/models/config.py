"""Hyper-parameters of the decoder LM (one family: Llama 2/3.x and Qwen2)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

from sao_jax.models.layers import rope as rope_lib

# HF `architectures` entries we can read and write.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM"}


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
    rope_scaling: RoPE scaling, () for none: the HF `rope_parameters` without
      rope_theta (rope_type 'linear', 'llama3', 'yarn' or 'dynamic' and its
      keys; `layers/rope.py`), a mapping or sorted (key, value) pairs
      (stored as the pairs).
    rms_norm_eps: RMSNorm epsilon.
    qkv_bias: Bias on the q/k/v projections (Qwen2: True).
    qk_norm: RMSNorm over each head's q and k before RoPE (Qwen3: True).
    tie_embeddings: Output projection = input embedding transposed.
    dtype: Compute dtype of activations (logits are always float32); e.g.
      'bfloat16' with float32 `param_dtype` (master weights and optimizer
      moments stay float32, matmuls run in bf16).
    param_dtype: Storage dtype of parameters.
    remat: Recompute each decoder block's activations in the backward pass
      (`nn.remat`): less activation memory for one more forward.
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
  remat: bool = False
  rope_scaling: Any = ()
  qk_norm: bool = False

  def __post_init__(self):
    object.__setattr__(self, "rope_scaling",
                       rope_lib.normalize_scaling(self.rope_scaling))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
      )
    jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)  # Fail early on typos.

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def params_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  def same_architecture(self, other: ModelConfig) -> bool:
    """Equal up to the run settings dtype, param_dtype and remat."""
    run = dict(dtype="float32", param_dtype="float32", remat=False)
    return (dataclasses.replace(self, **run) ==
            dataclasses.replace(other, **run))

  def num_params(self) -> int:
    """Exact number of parameters of the policy `Transformer`."""
    d, f, dh = self.hidden_size, self.intermediate_size, self.head_dim
    attn = d * dh * (self.num_heads * 2 + self.num_kv_heads * 2)
    if self.qkv_bias:
      attn += dh * (self.num_heads + 2 * self.num_kv_heads)
    if self.qk_norm:
      attn += 2 * dh
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
    elif model_type in _MODEL_TYPES:
      arch = _MODEL_TYPES[model_type]
    else:
      raise UnsupportedConfigError(
          f"config has neither a supported `architectures` entry nor "
          f"model_type in {tuple(_MODEL_TYPES)} (got architectures={archs}, "
          f"model_type={model_type!r})."
      )

    act = hf.get("hidden_act", "silu")
    if act != "silu":
      raise UnsupportedConfigError(
          f"hidden_act={act!r}; only 'silu' is supported.")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in ("dynamic", "yarn") and hf.get("max_position_embeddings"):
      rope.setdefault("max_position_embeddings", hf["max_position_embeddings"])
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
      raise UnsupportedConfigError(
          "partial_rotary_factor != 1 (RoPE on part of a head) is not "
          "supported.")
    rope.pop("partial_rotary_factor", None)
    try:
      rope_scaling = rope_lib.normalize_scaling(rope)
    except ValueError as e:
      raise UnsupportedConfigError(f"RoPE scaling: {e}") from e

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
            f"{arch} use_sliding_window=True is not supported.")
      qkv_bias = arch == "Qwen2ForCausalLM"
      if arch == "Qwen3ForCausalLM" and hf.get("attention_bias", False):
        raise UnsupportedConfigError(
            "Qwen3 attention_bias=True (bias on o_proj too) is not supported.")

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
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        qk_norm=arch == "Qwen3ForCausalLM",
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
    if self.qk_norm != (arch == "Qwen3ForCausalLM") or (
        arch == "Qwen3ForCausalLM" and self.qkv_bias):
      raise UnsupportedConfigError(
          f"{arch} cannot express qk_norm={self.qk_norm}, qkv_bias="
          f"{self.qkv_bias} (Qwen3ForCausalLM: q/k norms, no biases); export "
          f"as {self.hf_architecture()}.")
    cfg = {
        "architectures": [arch],
        "model_type": {v: k for k, v in _MODEL_TYPES.items()}[arch],
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
        "rope_parameters": self._hf_rope_parameters(),
        "tie_word_embeddings": self.tie_embeddings,
        "torch_dtype": self.param_dtype,
        "dtype": self.param_dtype,
    }
    if arch == "LlamaForCausalLM":
      cfg.update(attention_bias=False, mlp_bias=False)
    else:
      cfg.update(use_sliding_window=False)
    if arch == "Qwen3ForCausalLM":
      cfg.update(attention_bias=False)
    max_pos = dict(self.rope_scaling).get("max_position_embeddings")
    if max_pos:
      cfg["max_position_embeddings"] = max_pos
    return cfg

  def hf_architecture(self) -> str:
    """The HF architecture this config exports as by default."""
    if self.qk_norm:
      return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if self.qkv_bias else "LlamaForCausalLM"

  def _hf_rope_parameters(self) -> dict[str, Any]:
    """HF `rope_parameters` (max_position_embeddings is a top-level key)."""
    params = {k: v for k, v in self.rope_scaling
              if k != "max_position_embeddings"}
    params.setdefault("rope_type", "default")
    return {**params, "rope_theta": self.rope_theta}
