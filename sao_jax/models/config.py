"""Hyper-parameters of the decoder LM (one family: Llama 2/3.x and Qwen2)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

# Re-exported: every caller catches it from here.
from sao_jax.models.families.errors import UnsupportedConfigError  # pylint: disable=unused-import
from sao_jax.models.families.gemma3 import gemma3_from_hf
from sao_jax.models.families.gemma3 import gemma3_to_hf
from sao_jax.models.families.mistral import mistral_from_hf
from sao_jax.models.families.mistral import mistral_to_hf
from sao_jax.models.layers import rope as rope_lib

# HF `architectures` entries we can read and write.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                           "Glm4MoeForCausalLM", "MistralForCausalLM",
                           "Gemma3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                "glm4_moe": "Glm4MoeForCausalLM",
                "mistral": "MistralForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM"}
# `ModelConfig.norm_style` / `mlp_activation` values.
NORM_STYLES = ("llama", "gemma")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# `ModelConfig.layer_types` entries (HF names).
LAYER_TYPES = ("full_attention", "sliding_attention")
# Mixture-of-experts architectures and the router each uses.
MOE_ARCHITECTURES = {"Qwen3MoeForCausalLM": "softmax",
                     "Glm4MoeForCausalLM": "sigmoid"}
# `ModelConfig.attention` values (layers/attention.choose).
ATTENTION_IMPLEMENTATIONS = ("auto", "dense", "blockwise", "cudnn", "splash")


# `ModelConfig.remat_policy` values (transformer.remat_policy maps them).
REMAT_POLICIES = ("none", "full", "dots_saveable",
                  "dots_with_no_batch_dims_saveable")
# Logical axis name of the stacked layer axis (scan_layers); the sharding
# rules map it to no mesh axis.
LAYERS_AXIS = "layers"


# `MoeConfig.router` values (models/layers/moe.py).
ROUTERS = ("softmax", "sigmoid")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
  """The experts of a MoE layer (HF names in comments)."""

  num_experts: int  # num_experts / n_routed_experts / num_local_experts
  top_k: int  # num_experts_per_tok
  intermediate_size: int  # moe_intermediate_size, per expert
  router: str = "softmax"
  norm_topk_prob: bool = True
  n_group: int = 1  # sigmoid router: expert groups
  topk_group: int = 1  # sigmoid router: groups a token may use
  routed_scaling_factor: float = 1.0
  n_shared_experts: int = 0  # dense experts on every token (GLM)

  def __post_init__(self):
    if self.router not in ROUTERS:
      raise ValueError(f"MoE router {self.router!r} is not one of {ROUTERS}.")
    if not 0 < self.top_k <= self.num_experts:
      raise ValueError(f"MoE top_k={self.top_k} must be in [1, num_experts="
                       f"{self.num_experts}].")
    if self.num_experts % self.n_group or not 0 < self.topk_group <= (
        self.n_group):
      raise ValueError(
          f"MoE n_group={self.n_group} must divide num_experts="
          f"{self.num_experts} and topk_group={self.topk_group} be in "
          f"[1, n_group].")



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
    moe: The experts of the mixture-of-experts layers (None: a dense model).
    first_dense_layers: With `moe`, layers [0, first_dense_layers) keep the
      dense SwiGLU MLP (GLM-4.5 / DeepSeek-V3 `first_k_dense_replace`); the
      rest are MoE layers.
    rotary_dim: Leading channels of each head that RoPE rotates (GLM's
      partial rotary); 0 means all of head_dim.
    sliding_window: Every layer's sliding attention window (Mistral): a
      query sees keys fewer than this many tokens back, itself included
      (transformers' convention); 0 = full causal attention. With
      `layer_types`, only the 'sliding_attention' layers use it.
    layer_types: Per-layer attention kind, HF names ('full_attention' or
      'sliding_attention'; Gemma 3's interleaved local/global layers); ()
      means every layer is alike. Under `scan_layers` each layer's kind is a
      scanned input (one stack).
    local_rope_theta: RoPE base of the sliding layers (Gemma 3
      `rope_local_base_freq`; no rope scaling there); 0 = rope_theta.
    query_pre_attn_scalar: Attention scores are q.k / sqrt(this) (Gemma);
      0 = / sqrt(head_dim).
    norm_style: 'llama' (RMSNorm * w, pre-norm blocks) or 'gemma'
      ((1 + w) RMSNorm, extra norms after attention and after the MLP,
      embeddings scaled by sqrt(hidden_size)).
    mlp_activation: The gated MLP's activation: 'silu' or 'gelu_tanh'.
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
  moe: MoeConfig | None = None
  first_dense_layers: int = 0
  rotary_dim: int = 0
  rope_scaling: Any = ()
  qk_norm: bool = False
  sliding_window: int = 0
  layer_types: Any = ()
  local_rope_theta: float = 0.0
  query_pre_attn_scalar: float = 0.0
  norm_style: str = "llama"
  mlp_activation: str = "silu"

  def __post_init__(self):
    object.__setattr__(self, "rope_scaling",
                       rope_lib.normalize_scaling(self.rope_scaling))
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads} (grouped-query attention)."
      )
    jnp.dtype(self.dtype), jnp.dtype(self.param_dtype)  # Fail early on typos.
    if not 0 <= self.first_dense_layers <= self.num_layers:
      raise ValueError(f"first_dense_layers={self.first_dense_layers} must be "
                       f"in [0, num_layers={self.num_layers}].")
    if self.rotary_dim % 2 or not 0 <= self.rotary_dim <= self.head_dim:
      raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in "
                       f"[0, head_dim={self.head_dim}].")
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if self.layer_types and (
        len(self.layer_types) != self.num_layers or
        not set(self.layer_types) <= set(LAYER_TYPES)):
      raise ValueError(
          f"layer_types={self.layer_types} must be () or {self.num_layers} "
          f"entries from {LAYER_TYPES}.")
    if self.norm_style not in NORM_STYLES:
      raise ValueError(f"norm_style={self.norm_style!r}; expected one of "
                       f"{NORM_STYLES}.")
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"mlp_activation={self.mlp_activation!r}; expected "
                       f"one of {MLP_ACTIVATIONS}.")
    if self.sliding_window < 0:
      raise ValueError(f"sliding_window={self.sliding_window} must be >= 0 "
                       "(0: no window).")
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

  def is_moe_layer(self, i: int) -> bool:
    """Whether decoder layer i has routed experts."""
    return self.moe is not None and i >= self.first_dense_layers

  def stages(self) -> list[tuple[str, int, int, bool]]:
    """The runs of alike layers the scanned decoder stacks, in order:
    (subtree name, first layer, number of layers, sparse).

    A dense model is one run, `layers`; a MoE model `dense_layers` (its
    `first_dense_layers`, if any) then `moe_layers`.
    """
    if self.moe is None:
      return [("layers", 0, self.num_layers, False)]
    k = self.first_dense_layers
    return ([("dense_layers", 0, k, False)] if k else []) + [
        ("moe_layers", k, self.num_layers - k, True)]

  def is_local_layer(self, i: int) -> bool:
    """Whether layer i attends through the sliding window."""
    if self.layer_types:
      return self.layer_types[i] == "sliding_attention"
    return bool(self.sliding_window)

  @property
  def num_moe_layers(self) -> int:
    return sum(map(self.is_moe_layer, range(self.num_layers)))

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
    if self.qk_norm:
      attn += 2 * dh
    dense = attn + 3 * d * f + (4 if self.norm_style == "gemma" else 2) * d
    layers = self.num_layers * dense
    if self.moe is not None:
      moe = self.moe
      sparse = attn + 2 * d + d * moe.num_experts + 3 * d * (
          moe.intermediate_size * (moe.num_experts + moe.n_shared_experts))
      if moe.router == "sigmoid":
        sparse += moe.num_experts  # The score-correction bias.
      layers += self.num_moe_layers * (sparse - dense)
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + layers + d + head

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
    if rope.get("partial_rotary_factor", 1.0) != 1.0 and (
        arch != "Glm4MoeForCausalLM"):
      raise UnsupportedConfigError(
          "partial_rotary_factor != 1 (RoPE on part of a head) is only "
          "supported for Glm4MoeForCausalLM.")
    partial = rope.pop("partial_rotary_factor", None)
    try:
      rope_scaling = rope_lib.normalize_scaling(rope)
    except ValueError as e:
      raise UnsupportedConfigError(f"RoPE scaling: {e}") from e
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // num_heads
    extra: dict[str, Any] = {}

    if arch == "Gemma3ForCausalLM":
      return cls(**gemma3_from_hf(hf))
    if arch == "MistralForCausalLM":
      qkv_bias, extra = False, mistral_from_hf(hf)
    elif arch == "LlamaForCausalLM":
      if hf.get("attention_bias", False):
        raise UnsupportedConfigError(
            "Llama attention_bias=True (bias on o_proj) is not supported.")
      if hf.get("mlp_bias", False):
        raise UnsupportedConfigError("Llama mlp_bias=True is not supported.")
      qkv_bias = False
    elif arch == "Glm4MoeForCausalLM":
      qkv_bias, extra = _glm4_moe_from_hf(hf, partial or 1.0, head_dim)
    elif arch == "Qwen3MoeForCausalLM":
      qkv_bias, extra = False, _qwen3_moe_from_hf(hf)
    else:
      if hf.get("use_sliding_window", False):
        raise UnsupportedConfigError(
            f"{arch} use_sliding_window=True is not supported.")
      qkv_bias = arch == "Qwen2ForCausalLM"
      if arch == "Qwen3ForCausalLM" and hf.get("attention_bias", False):
        raise UnsupportedConfigError(
            "Qwen3 attention_bias=True (bias on o_proj too) is not supported.")

    return cls(
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        rope_theta=float(rope_theta),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        qk_norm=extra.pop("qk_norm", arch == "Qwen3ForCausalLM"),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **extra,
    )

  def to_hf_config(self, arch: str = "LlamaForCausalLM") -> dict[str, Any]:
    """The HF `config.json` dict for `arch` (inverse of `from_hf_config`)."""
    if arch not in SUPPORTED_ARCHITECTURES:
      raise UnsupportedConfigError(
          f"Unsupported architecture {arch!r}; supported: "
          f"{list(SUPPORTED_ARCHITECTURES)}."
      )
    gemma = (self.norm_style, self.mlp_activation) != ("llama", "silu") or (
        self.layer_types or self.query_pre_attn_scalar or
        self.local_rope_theta)
    if arch == "Gemma3ForCausalLM":
      return gemma3_to_hf(self)
    if gemma:
      raise UnsupportedConfigError(
          f"{arch} cannot express a Gemma-style config (norm_style, "
          "mlp_activation, layer_types, query_pre_attn_scalar, "
          "local_rope_theta); export as Gemma3ForCausalLM.")
    if self.sliding_window and arch != "MistralForCausalLM":
      raise UnsupportedConfigError(
          f"{arch} cannot express sliding_window={self.sliding_window}; export "
          "as MistralForCausalLM.")
    if arch in ("LlamaForCausalLM", "MistralForCausalLM") and self.qkv_bias:
      raise UnsupportedConfigError(
          "LlamaForCausalLM cannot express qkv_bias=True (its attention_bias "
          "also adds an o_proj bias); export as Qwen2ForCausalLM instead.")
    if (arch in MOE_ARCHITECTURES) != (self.moe is not None) or (
        self.moe is not None and MOE_ARCHITECTURES[arch] != self.moe.router):
      raise UnsupportedConfigError(
          f"{arch} cannot express moe={self.moe}: export as "
          f"{self.hf_architecture()}.")
    if arch == "Qwen2ForCausalLM" and not self.qkv_bias:
      raise UnsupportedConfigError(
          "Qwen2ForCausalLM always has q/k/v biases; this config has "
          "qkv_bias=False, export as LlamaForCausalLM instead.")
    qwen3 = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    if arch != "Glm4MoeForCausalLM" and (
        self.qk_norm != qwen3 or (qwen3 and self.qkv_bias)):
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
    elif arch == "MistralForCausalLM":
      cfg.update(mistral_to_hf(self))
    elif arch == "Glm4MoeForCausalLM":
      cfg.update(_glm4_moe_to_hf(self))
    elif arch == "Qwen3MoeForCausalLM":
      cfg.update(_qwen3_moe_to_hf(self))
    else:
      cfg.update(use_sliding_window=False)
    if qwen3:
      cfg.update(attention_bias=False)
    max_pos = dict(self.rope_scaling).get("max_position_embeddings")
    if max_pos:
      cfg["max_position_embeddings"] = max_pos
    return cfg

  def hf_architecture(self) -> str:
    """The HF architecture this config exports as by default."""
    if self.moe is not None:
      return {v: k for k, v in MOE_ARCHITECTURES.items()}[self.moe.router]
    if self.norm_style == "gemma":
      return "Gemma3ForCausalLM"
    if self.sliding_window:
      return "MistralForCausalLM"
    if self.qk_norm:
      return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if self.qkv_bias else "LlamaForCausalLM"

  def _hf_rope_parameters(self) -> dict[str, Any]:
    """HF `rope_parameters` (max_position_embeddings is a top-level key)."""
    params = {k: v for k, v in self.rope_scaling
              if k != "max_position_embeddings"}
    params.setdefault("rope_type", "default")
    return {**params, "rope_theta": self.rope_theta}

def _glm4_moe_from_hf(hf: Mapping[str, Any], partial_rotary_factor: float,
                      head_dim: int) -> tuple[bool, dict[str, Any]]:
  """(qkv_bias, the MoE and rotary fields) of a GLM-4.5-style config."""
  moe = MoeConfig(
      num_experts=int(hf["n_routed_experts"]),
      top_k=int(hf["num_experts_per_tok"]),
      intermediate_size=int(hf["moe_intermediate_size"]),
      router="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
      n_group=int(hf.get("n_group", 1)),
      topk_group=int(hf.get("topk_group", 1)),
      routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
      n_shared_experts=int(hf.get("n_shared_experts", 0)))
  rotary = int(head_dim * float(partial_rotary_factor))
  return bool(hf.get("attention_bias", False)), dict(
      moe=moe, first_dense_layers=int(hf.get("first_k_dense_replace", 0)),
      rotary_dim=0 if rotary == head_dim else rotary,
      qk_norm=bool(hf.get("use_qk_norm", False)))


def _qwen3_moe_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The MoE fields of a Qwen3-MoE config (q/k norms, softmax routing)."""
  if hf.get("use_sliding_window", False):
    raise UnsupportedConfigError(
        "Qwen3-MoE use_sliding_window=True is not supported.")
  n = int(hf["num_hidden_layers"])
  step = int(hf.get("decoder_sparse_step", 1))
  dense = sorted(int(i) for i in hf.get("mlp_only_layers") or [])
  if step != 1 or dense != list(range(len(dense))):
    raise UnsupportedConfigError(
        f"Qwen3-MoE decoder_sparse_step={step}, mlp_only_layers={dense}: only "
        "MoE layers after an optional dense prefix (step 1, mlp_only_layers "
        "= [0, ..., k-1]) are supported.")
  moe = MoeConfig(
      # transformers 5 writes num_local_experts; the hub's configs num_experts.
      num_experts=int(hf["num_experts"] if "num_experts" in hf
                      else hf["num_local_experts"]),
      top_k=int(hf["num_experts_per_tok"]),
      intermediate_size=int(hf["moe_intermediate_size"]),
      router="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
  return dict(moe=moe, first_dense_layers=min(len(dense), n), qk_norm=True)


def _qwen3_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The Qwen3-MoE fields of `cfg.to_hf_config`."""
  moe = cfg.moe
  if moe.n_shared_experts or moe.routed_scaling_factor != 1.0:
    raise UnsupportedConfigError(
        "Qwen3MoeForCausalLM has no shared experts and no routed scaling.")
  return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
          "moe_intermediate_size": moe.intermediate_size,
          "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
          "mlp_only_layers": list(range(cfg.first_dense_layers)),
          "use_sliding_window": False}


def _glm4_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
  """The GLM-4.5-style fields of `cfg.to_hf_config`."""
  moe = cfg.moe
  if moe.router != "sigmoid":
    raise UnsupportedConfigError(
        f"Glm4MoeForCausalLM routes with sigmoid scores; this config's router "
        f"is {moe.router!r}.")
  factor = (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim
  return {
      "attention_bias": cfg.qkv_bias, "use_qk_norm": cfg.qk_norm,
      "n_routed_experts": moe.num_experts,
      "num_experts_per_tok": moe.top_k,
      "moe_intermediate_size": moe.intermediate_size,
      "norm_topk_prob": moe.norm_topk_prob, "n_group": moe.n_group,
      "topk_group": moe.topk_group,
      "routed_scaling_factor": moe.routed_scaling_factor,
      "n_shared_experts": moe.n_shared_experts,
      "first_k_dense_replace": cfg.first_dense_layers,
      "num_nextn_predict_layers": 0,
      "rope_parameters": {**cfg._hf_rope_parameters(),  # pylint: disable=protected-access
                          "partial_rotary_factor": factor},
  }
