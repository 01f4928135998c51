"""The HF <-> ours tensor correspondence of a `ModelConfig` (models/hf.py).

One `Entry` per HF tensor: its name, shape and the reshapes both ways. The
names are the shared Llama-like ones (`model.layers.{i}.self_attn.*`,
`mlp.*`, the MoE layers' `mlp.gate` / `mlp.experts.{e}.*` /
`mlp.shared_experts.*`); what a family names differently (Gemma 3's four
norms, Phi-3's fused `qkv_proj` / `gate_up_proj`) its
`families.registry.Family` declares. A fused HF tensor is several entries,
each a `part` (a range of its rows) of one of our parameters. HF stores
`nn.Linear` weights as [out, in]; ours are [in, ...out] with heads split
out, e.g. q_proj.weight [H*Dh, D] <-> q_proj [D, H, Dh]. With `scan_layers`
the L per-layer tensors of a parameter form one stacked [L, ...] leaf
(docs/design/models.md "Layer layout").
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from sao_jax.models.config import ModelConfig
from sao_jax.models.families import registry


@dataclasses.dataclass(frozen=True)
class Entry:
  """One HF tensor <-> one of our parameters."""

  path: tuple[str, ...]  # Key path in our params dict.
  hf_name: str
  hf_shape: tuple[int, ...]
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  layer: int | None = None  # Index on the stacked leaf's [L] axis.
  expert: int | None = None  # Index on an expert leaf's [E] axis.
  # Rows [start, stop) of the fused HF tensor `hf_name` (of shape
  # `hf_shape`) that are this parameter; None: the whole tensor.
  part: tuple[int, int] | None = None
  # The fused tensor's rows as `groups` equal blocks, each holding every
  # part's share in part order (Qwen3-Next's in_proj_qkvz: per key head
  # q, k, v, z); `part` is then a row range of each block.
  groups: int = 1


def take_part(e: Entry, whole: np.ndarray) -> np.ndarray:
  """Entry e's rows of its whole fused HF tensor (in block order)."""
  blocks = whole.reshape(e.groups, -1, *whole.shape[1:])
  return blocks[:, e.part[0]:e.part[1]].reshape(-1, *whole.shape[1:])


def join_parts(parts: list[tuple[Entry, np.ndarray]]) -> np.ndarray:
  """A fused HF tensor from its parts' rows (the inverse of `take_part`)."""
  parts = sorted(parts, key=lambda p: p[0].part[0])
  blocks = [x.reshape(e.groups, -1, *x.shape[1:]) for e, x in parts]
  out = np.concatenate(blocks, axis=1)
  return out.reshape(-1, *out.shape[2:])


def _fuse(cfg: ModelConfig, out: list[Entry],
          fused: tuple[tuple[str, ...], ...]) -> list[Entry]:
  """`out` with each layer's tensors `{prefix}{part}.weight` of a fusion
  (fused name, part names[, the `ModelConfig` field counting its row
  blocks]) replaced by row ranges of `{prefix}{fused}.weight` (rows in part
  order, as HF's split / chunk reads them; with blocks, in each block)."""
  for fused_name, parts, *blocks in fused:
    groups = int(getattr(cfg, blocks[0])) if blocks else 1
    suffixes = tuple(f".{p}.weight" for p in parts)
    layers: dict[str, list[int]] = {}
    for j, e in enumerate(out):
      for k, suffix in enumerate(suffixes):
        if e.hf_name.endswith(suffix):
          prefix = e.hf_name[:-len(suffix) + 1]
          layers.setdefault(prefix, [None] * len(parts))[k] = j
    for prefix, idx in layers.items():
      if None in idx:
        raise ValueError(
            f"{prefix}: a fused {fused_name} lacks one of {parts}.")
      rows, start = sum(out[j].hf_shape[0] for j in idx), 0
      for j in idx:
        e = out[j]
        share = e.hf_shape[0] // groups  # Its rows in each block.
        out[j] = dataclasses.replace(
            e, hf_name=f"{prefix}{fused_name}.weight",
            hf_shape=(rows,) + e.hf_shape[1:],
            part=(start, start + share), groups=groups)
        start += share
  return out


def _attention_entries(cfg: ModelConfig, hf: str, attn: tuple[str, ...],
                       i: int) -> list[Entry]:
  """Layer i's attention tensors (q/k/v biases: Qwen2; q/k norms: Qwen3,
  Gemma 3, GLM-4.5, full-width: OLMo 2/3; Gemma 4's global layers: their
  own shapes, no v_proj with attention_k_eq_v)."""
  d, h = cfg.hidden_size, cfg.num_heads
  hkv, dh, k_eq_v = cfg.attention_dims(i)
  same = lambda x: x
  out = []
  names = (("q", h),) if cfg.kv_source(i) != i else (  # Shared KV: q, o.
      (("q", h), ("k", hkv)) + ((("v", hkv),) if not k_eq_v else ()))
  for name, heads in names:
    # Qwen3.5's gated q_proj: per head, the query's rows then the gate's.
    w = 2 * dh if name == "q" and cfg.attn_output_gate else dh
    out.append(Entry(
        attn + (f"{name}_proj",), f"{hf}self_attn.{name}_proj.weight",
        (heads * w, d), lambda x, n=heads, w=w: x.T.reshape(d, n, w),
        lambda k, n=heads, w=w: k.reshape(d, n * w).T))
    if cfg.qkv_bias:
      out.append(Entry(
          attn + (f"{name}_bias",), f"{hf}self_attn.{name}_proj.bias",
          (heads * dh,), lambda b, n=heads: b.reshape(n, dh),
          lambda b, n=heads: b.reshape(n * dh)))
    if cfg.qk_norm and name != "v":
      full = cfg.qk_norm_full_width  # OLMo 2/3: [H*Dh] <-> [H, Dh].
      out.append(Entry(
          attn + (f"{name}_norm", "scale"),
          f"{hf}self_attn.{name}_norm.weight", (heads * dh if full else dh,),
          (lambda w, n=heads: w.reshape(n, dh)) if full else same,
          (lambda w, n=heads: w.reshape(n * dh)) if full else same))
  out.append(Entry(attn + ("o_proj",), f"{hf}self_attn.o_proj.weight",
                   (d, h * dh), lambda w: w.T.reshape(h, dh, d),
                   lambda k: k.reshape(h * dh, d).T))
  return out


def _linear_entries(cfg: ModelConfig, hf: str,
                    ours: tuple[str, ...]) -> list[Entry]:
  """One Gated DeltaNet layer's tensors (HF `linear_attn.*`): the fused
  conv1d rows (q, k, v) are our per-part params; the input projections are
  one `in_proj_{q,k,v,z,b,a}` each, which a family fuses its way (Qwen3.5's
  in_proj_qkv; Qwen3-Next's in_proj_qkvz / in_proj_ba per key head)."""
  d, a = cfg.hidden_size, f"{hf}linear_attn."
  hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
  hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
  kernel = cfg.linear_conv_kernel_dim
  same, t = (lambda x: x), (lambda x: x.T)
  parts = (("q", hk, dk), ("k", hk, dk), ("v", hv, dv))
  rows = 2 * hk * dk + hv * dv
  out, start = [], 0
  for name, heads, dim in parts:
    part = (start, start + heads * dim)
    out += [
        Entry(ours + (f"{name}_proj",), f"{a}in_proj_{name}.weight",
              (heads * dim, d), lambda w, n=heads, k=dim: w.T.reshape(d, n, k),
              lambda w, n=heads, k=dim: w.reshape(d, n * k).T),
        Entry(ours + (f"{name}_conv",), f"{a}conv1d.weight",
              (rows, 1, kernel),
              lambda w, n=heads, k=dim: w.reshape(n, k, kernel),
              lambda w, n=heads, k=dim: w.reshape(n * k, 1, kernel),
              part=part)]
    start = part[1]
  return out + [
      Entry(ours + ("z_proj",), f"{a}in_proj_z.weight", (hv * dv, d),
            lambda w: w.T.reshape(d, hv, dv), lambda w: w.reshape(d, -1).T),
      Entry(ours + ("b_proj",), f"{a}in_proj_b.weight", (hv, d), t, t),
      Entry(ours + ("a_proj",), f"{a}in_proj_a.weight", (hv, d), t, t),
      Entry(ours + ("dt_bias",), f"{a}dt_bias", (hv,), same, same),
      Entry(ours + ("A_log",), f"{a}A_log", (hv,), same, same),
      Entry(ours + ("norm_scale",), f"{a}norm.weight", (dv,), same, same),
      Entry(ours + ("o_proj",), f"{a}out_proj.weight", (d, hv * dv),
            lambda w: w.T.reshape(hv, dv, d), lambda w: w.reshape(-1, d).T)]


def _layer_path(cfg: ModelConfig, name: str, i: int
                ) -> tuple[tuple[str, ...], int | None]:
  """Layer i's subtree in our params and its index on the stacked axis (None:
  unstacked): `layers_{i}`, a stage's stack, or a hybrid decoder's member
  of repeat i // pattern (transformer.LayerGroup)."""
  if not cfg.scan_layers:
    return ("decoder", f"layers_{i}"), None
  if not cfg.grouped:
    return ("decoder", name), None
  p = cfg.layer_pattern()
  return ("decoder", "layer_groups", cfg.member_name(i % p)), i // p


def _deinterleave(x: np.ndarray, dr: int, axis: int,
                  inverse: bool = False) -> np.ndarray:
  """The last `dr` entries of `axis` from DeepSeek's interleaved RoPE pairs
  (x0, x1), (x2, x3), ... to the rotate_half layout (evens, then odds): the
  same rotation (transformers' apply_rotary_pos_emb_interleave), so our
  RoPE applies unchanged; `inverse` back."""
  perm = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])
  if inverse:
    perm = np.argsort(perm)
  n = x.shape[axis]
  index = np.concatenate([np.arange(n - dr), n - dr + perm])
  return np.take(x, index, axis=axis)


def _mla_entries(cfg: ModelConfig, hf: str,
                 attn: tuple[str, ...]) -> list[Entry]:
  """One layer's multi-head latent attention tensors (DeepSeek-V3 names;
  layers/mla.py), RoPE channels de-interleaved on import."""
  d, dh, h = cfg.hidden_size, cfg.head_dim, cfg.num_heads
  r, rq, dr, dv = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.qk_rope_head_dim,
                   cfg.v_head_dim)
  same, t = (lambda x: x), (lambda x: x.T)
  a = f"{hf}self_attn."

  def heads_in(rows: int):  # [H*Dh, rows] <-> [rows, H, Dh], both ways.
    return (lambda w: _deinterleave(w.T.reshape(rows, h, dh), dr, 2),
            lambda k: _deinterleave(k, dr, 2, True).reshape(rows, h * dh).T)

  if rq:
    out = [Entry(attn + ("q_a_proj",), f"{a}q_a_proj.weight", (rq, d), t, t),
           Entry(attn + ("q_a_norm", "scale"), f"{a}q_a_layernorm.weight",
                 (rq,), same, same),
           Entry(attn + ("q_b_proj",), f"{a}q_b_proj.weight", (h * dh, rq),
                 *heads_in(rq))]
  else:
    out = [Entry(attn + ("q_proj",), f"{a}q_proj.weight", (h * dh, d),
                 *heads_in(d))]
  dkv = dh - dr + dv
  return out + [
      Entry(attn + ("kv_a_proj",), f"{a}kv_a_proj_with_mqa.weight",
            (r + dr, d), lambda w: _deinterleave(w, dr, 0).T,
            lambda k: _deinterleave(k.T, dr, 0, True)),
      Entry(attn + ("kv_a_norm", "scale"), f"{a}kv_a_layernorm.weight", (r,),
            same, same),
      Entry(attn + ("kv_b_proj",), f"{a}kv_b_proj.weight", (h * dkv, r),
            lambda w: w.T.reshape(r, h, dkv),
            lambda k: k.reshape(r, h * dkv).T),
      Entry(attn + ("o_proj",), f"{a}o_proj.weight", (d, h * dv),
            lambda w: w.T.reshape(h, dv, d), lambda k: k.reshape(h * dv, d).T)]


def _moe_entries(cfg: ModelConfig, hf: str,
                 moe: tuple[str, ...]) -> list[Entry]:
  """One MoE layer's router, experts (one HF tensor per expert) and shared
  experts (HF Qwen3-MoE / GLM-4.5 / Qwen3-Next names)."""
  d, m = cfg.hidden_size, cfg.moe
  f, e_count = m.intermediate_size, m.num_experts
  same, t = (lambda x: x), (lambda x: x.T)
  out = [Entry(moe + ("router_kernel",), f"{hf}mlp.gate.weight", (e_count, d),
               t, t)]
  if m.router == "sigmoid":
    out.append(Entry(moe + ("router_bias",),
                     f"{hf}mlp.gate.e_score_correction_bias", (e_count,),
                     same, same))
  for e in range(e_count):
    for name, shape in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
      out.append(Entry(moe + (f"{name}_proj",),
                       f"{hf}mlp.experts.{e}.{name}_proj.weight", shape, t, t,
                       expert=e))
  if m.n_shared_experts:
    fs = m.shared_width
    # Qwen's gated shared expert (Qwen2-MoE, Qwen3-Next) is `shared_expert`,
    # GLM's and DeepSeek's `shared_experts`.
    shared = "shared_expert" if m.shared_expert_gate else "shared_experts"
    for name, shape in (("gate", (fs, d)), ("up", (fs, d)), ("down", (d, fs))):
      out.append(Entry(moe + (f"shared_{name}_proj",),
                       f"{hf}mlp.{shared}.{name}_proj.weight", shape, t, t))
    if m.shared_expert_gate:
      out.append(Entry(moe + ("shared_expert_gate",),
                       f"{hf}mlp.shared_expert_gate.weight", (1, d),
                       lambda w: w[0], lambda w: w[None]))
  return out


def stacked(group: list[Entry], xs: list[np.ndarray]) -> np.ndarray:
  """One leaf from its entries' tensors: [L?, E?, ...] by layer, expert."""
  e = group[0]
  if e.layer is None and e.expert is None:
    return xs[0]
  lead = tuple(len({getattr(g, a) for g in group}) for a in ("layer", "expert")
               if getattr(e, a) is not None)
  return np.stack(xs).reshape(lead + xs[0].shape)


def entries(cfg: ModelConfig, arch: str | None = None) -> list[Entry]:
  """The full HF <-> ours correspondence for `cfg` as HF architecture `arch`
  (None: `cfg.hf_architecture()`)."""
  family = registry.get(arch or cfg.hf_architecture())
  norm_names = family.norm_names
  d, f = cfg.hidden_size, cfg.intermediate_size
  same = lambda x: x
  t = lambda x: x.T

  out = [Entry(("decoder", "embedder", "embedding"),
               "model.embed_tokens.weight", (cfg.vocab_size, d), same, same)]
  ple = cfg.per_layer_input_size  # Gemma 4's per-layer embeddings.
  if ple:
    w, pl = cfg.num_layers * ple, ("decoder", "per_layer")
    out += [Entry(pl + ("embedding",), "model.embed_tokens_per_layer.weight",
                  (cfg.vocab_size, w), same, same),
            Entry(pl + ("projection",),
                  "model.per_layer_model_projection.weight", (w, d), t, t),
            Entry(pl + ("norm", "scale"),
                  "model.per_layer_projection_norm.weight", (ple,), same,
                  same)]
  for name, first, count, sparse in cfg.stages():
    for i in range(first, first + count):
      start = len(out)
      hf = f"model.layers.{i}."
      ours, index = _layer_path(cfg, name, i)
      if cfg.is_linear_layer(i):
        out += _linear_entries(cfg, hf, ours + ("linear_attn",))
      else:
        out += _mla_entries(cfg, hf, ours + ("attn",)) if cfg.mla else (
            _attention_entries(cfg, hf, ours + ("attn",), i))
      f = cfg.mlp_size(i)
      out += _moe_entries(cfg, hf, ours + ("moe",)) if sparse else [
          Entry(ours + ("mlp", f"{p}_proj"), f"{hf}mlp.{p}_proj.weight",
                shape, t, t)
          for p, shape in (("gate", (f, d)), ("up", (f, d)),
                           ("down", (d, f)))]
      out += [Entry(ours + (ours_name, "scale"), f"{hf}{hf_name}.weight",
                    (d,), same, same) for ours_name, hf_name in norm_names]
      if cfg.norm_style == "gemma4":  # A buffer in transformers.
        out.append(Entry(ours + ("layer_scalar",), f"{hf}layer_scalar", (1,),
                         same, same))
      if ple:
        pl = ours + ("per_layer",)
        out += [Entry(pl + ("gate",), f"{hf}per_layer_input_gate.weight",
                      (ple, d), t, t),
                Entry(pl + ("projection",), f"{hf}per_layer_projection.weight",
                      (d, ple), t, t),
                Entry(pl + ("post_norm", "scale"),
                      f"{hf}post_per_layer_input_norm.weight", (d,), same,
                      same)]
      if cfg.scan_layers:  # Layer i of the stage's stacked leaves.
        out[start:] = [dataclasses.replace(
            e, layer=i - first if index is None else index)
                       for e in out[start:]]
  out.append(Entry(("decoder", "final_norm", "scale"), "model.norm.weight",
                   (d,), same, same))
  if not cfg.tie_embeddings:
    out.append(Entry(("lm_head",), "lm_head.weight", (cfg.vocab_size, d), t,
                     t))
  return _fuse(cfg, out, family.fused) if family.fused else out


def groups(all_entries: list[Entry]) -> list[list[Entry]]:
  """Entries by parameter: one per leaf, a stacked leaf's L in layer order."""
  by_path: dict[tuple[str, ...], list[Entry]] = {}
  for e in all_entries:
    by_path.setdefault(e.path, []).append(e)
  return list(by_path.values())
