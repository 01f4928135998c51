"""Gated DeltaNet linear attention: the gated delta rule and its short conv.

The kernels of Qwen3.5's and Qwen3-Next's linear-attention layers (Yang et
al. 2024, "Gated Delta Networks", arXiv 2412.06464), in float32, as
transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_
delta_rule` / `causal_conv1d_fn` / `causal_conv1d_update` compute them.
Per value head, a state S [Dk, Dv] runs over the tokens:

  S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

with q, k L2-normalised and q scaled by Dk^-1/2. Two forms give the same
numbers: `recurrent_gated_delta_rule`, one token at a time (generation: a
fixed-size state per sequence instead of a KV cache), and
`chunked_gated_delta_rule`, the training form: within a chunk of C tokens
the updates are one unit-lower-triangular solve (the UT transform) and
matmuls, and a scan carries S across chunks, so memory grows with T x C, not
T^2. Both take and return the state, so a prefill can hand it to decode
steps. `GatedDeltaNet` is Qwen3.5's layer around them (projections, the
short conv, decay and write gates, a gated RMSNorm), a token mixer of the
hybrid decoder (`transformer.DecoderLayer` with `linear`), whose state the
sampler's cache holds (`KVCache.linear`).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param

Array = jax.Array


def l2norm(x: Array, eps: float = 1e-6) -> Array:
  """x / sqrt(sum(x^2) + eps) over the last axis (the FLA library's form)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, normalize):
  """float32, key heads repeated to the value heads, q/k normalised, q
  scaled; heads moved before time: q, k [B, H, T, Dk], v [B, H, T, Dv],
  g, beta [B, H, T]."""
  rep = v.shape[2] // k.shape[2]  # Key head j serves value heads j*rep...
  q, k = (jnp.repeat(x, rep, axis=2) for x in (q, k))
  q, k, v, g, beta = (jnp.swapaxes(x.astype(jnp.float32), 1, 2)
                      for x in (q, k, v, g, beta))
  if normalize:
    q, k = l2norm(q), l2norm(k)
  return q * q.shape[-1] ** -0.5, k, v, g, beta


def _zero_state(q: Array, v: Array) -> Array:
  return jnp.zeros(q.shape[:2] + (q.shape[-1], v.shape[-1]), jnp.float32)


def recurrent_gated_delta_rule(q: Array, k: Array, v: Array, g: Array,
                               beta: Array, state: Array | None = None,
                               normalize: bool = True
                               ) -> tuple[Array, Array]:
  """The gated delta rule token by token.

  Args:
    q, k: [B, T, Hk, Dk] queries and keys.
    v: [B, T, Hv, Dv] values (Hv a multiple of Hk).
    g: [B, T, Hv] log decays (<= 0).
    beta: [B, T, Hv] write strengths in [0, 1].
    state: [B, Hv, Dk, Dv] float32 state before the first token (None: 0).
    normalize: L2-normalise q and k (Qwen3.5's use_qk_l2norm_in_kernel).

  Returns:
    (out [B, T, Hv, Dv] float32, state after the last token).
  """
  q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
  s0 = _zero_state(q, v) if state is None else state.astype(jnp.float32)

  def step(s, xs):
    q_t, k_t, v_t, g_t, b_t = xs
    s = s * jnp.exp(g_t)[..., None, None]
    delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
    s = s + k_t[..., None] * delta[..., None, :]
    return s, jnp.einsum("bhkv,bhk->bhv", s, q_t)

  time_major = tuple(jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta))
  state, out = jax.lax.scan(step, s0, time_major)
  return jnp.moveaxis(out, 0, 1), state  # [T, B, H, Dv] -> [B, T, H, Dv].


def _substitute(a: Array, b: Array) -> Array:
  """x with (I + strictly_lower(a)) x = b: forward substitution, a row of
  the C x C system at a time (``lax.fori_loop``; rows not yet solved are
  zero, so a's diagonal and upper part never count)."""
  a = jnp.tril(a, -1)

  def row(i, x):
    a_i = jax.lax.dynamic_index_in_dim(a, i, axis=-2, keepdims=False)
    b_i = jax.lax.dynamic_index_in_dim(b, i, axis=-2, keepdims=False)
    x_i = b_i - jnp.einsum("...j,...jd->...d", a_i, x)
    return jax.lax.dynamic_update_index_in_dim(x, x_i, i, axis=-2)

  return jax.lax.fori_loop(0, a.shape[-1], row, jnp.zeros_like(b))


def _lower_solve(a: Array, b: Array) -> Array:
  """(I + strictly_lower(a))^-1 b. XLA's triangular solve on TPU and GPU;
  forward substitution on CPU, where the solve is LAPACK's batched trsm
  through jaxlib's FFI, whose ParallelBatchMap waits on the XLA thread pool
  it runs on: two solves of one program running at once on a 2-thread pool
  (a 2-core machine) each wait for work the other's thread would do, and
  the step never returns (jaxlib 0.10.2; seen as a hung SAO step of a
  hybrid model in a CI run)."""
  return jax.lax.platform_dependent(
      a, b, cpu=_substitute,
      default=lambda a, b: jax.lax.linalg.triangular_solve(
          a, b, left_side=True, lower=True, unit_diagonal=True))


@jax.custom_vjp
def unit_lower_solve(a: Array, b: Array) -> Array:
  """x = (I + strictly_lower(a))^-1 b over the last two axes of a [..., C,
  C] and b [..., C, D], with the gradients of ``lax.linalg.triangular_solve``
  (unit diagonal): db = A^-T g, da = strictly_lower(-db x^T)."""
  return _lower_solve(a, b)


def _unit_lower_solve_fwd(a, b):
  x = _lower_solve(a, b)
  return x, (a, x)


def _unit_lower_solve_bwd(residuals, g):
  a, x = residuals
  # A^T is unit upper; reversing rows and columns makes it unit lower.
  flipped = jnp.flip(jnp.swapaxes(a, -1, -2), (-2, -1))
  db = jnp.flip(_lower_solve(flipped, jnp.flip(g, -2)), -2)
  da = jnp.tril(-jnp.einsum("...id,...jd->...ij", db, x), -1)
  return da.astype(a.dtype), db.astype(g.dtype)


unit_lower_solve.defvjp(_unit_lower_solve_fwd, _unit_lower_solve_bwd)


def chunked_gated_delta_rule(q: Array, k: Array, v: Array, g: Array,
                             beta: Array, state: Array | None = None,
                             chunk: int = 64, normalize: bool = True
                             ) -> tuple[Array, Array]:
  """The gated delta rule a chunk of `chunk` tokens at a time.

  Same arguments and results as `recurrent_gated_delta_rule`; T need not be
  a multiple of `chunk` (the tail is padded with tokens that neither decay
  nor write the state).
  """
  q, k, v, g, beta = _prepare(q, k, v, g, beta, normalize)
  b, h, t, _ = q.shape
  n = -(-t // chunk)
  pad = n * chunk - t
  padded = [jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
            for x in (q, k, v, g, beta)]
  q, k, v, g, beta = (x.reshape(b, h, n, chunk, *x.shape[3:])
                      for x in padded)
  k_beta, v_beta = k * beta[..., None], v * beta[..., None]
  cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C] log decay from chunk start.
  causal = jnp.tril(jnp.ones((chunk, chunk), bool))
  pair = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :],
                           -jnp.inf))  # Decay from token j to token i <= j.
  ut = jnp.einsum("bhnik,bhnjk->bhnij", k_beta, k) * pair
  intra = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * pair
  # (I + strictly_lower(ut))^-1 applied to both right-hand sides at once.
  rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
  solved = unit_lower_solve(ut, rhs)
  dv = v.shape[-1]
  new_values, k_cumdecay = solved[..., :dv], solved[..., dv:]
  q = q * jnp.exp(cum)[..., None]
  k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
  chunk_decay = jnp.exp(cum[..., -1])[..., None, None]  # [B, H, N, 1, 1]

  def step(s, xs):
    q_n, k_n, new_n, kcd_n, intra_n, decay_n = xs
    v_new = new_n - jnp.einsum("bhck,bhkv->bhcv", kcd_n, s)
    out = (jnp.einsum("bhck,bhkv->bhcv", q_n, s) +
           jnp.einsum("bhcj,bhjv->bhcv", intra_n, v_new))
    s = s * decay_n + jnp.einsum("bhck,bhcv->bhkv", k_n, v_new)
    return s, out

  s0 = _zero_state(q, v) if state is None else state.astype(jnp.float32)
  chunks = tuple(jnp.moveaxis(x, 2, 0) for x in (
      q, k, new_values, k_cumdecay, intra, chunk_decay))
  state, out = jax.lax.scan(step, s0, chunks)  # out [N, B, H, C, Dv].
  out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
  return jnp.swapaxes(out, 1, 2), state


def causal_conv1d(x: Array, weight: Array, state: Array | None = None,
                  end: Array | None = None) -> tuple[Array, Array]:
  """Depthwise causal convolution over time, then SiLU.

  Args:
    x: [B, T, C] inputs.
    weight: [C, K] one K-tap filter per channel (HF conv1d.weight [C, 1, K]
      squeezed), tap K-1 on the current token.
    state: [B, C, K-1] the K-1 inputs before x (None: zeros, a sequence's
      start).
    end: int32 [B] one past each row's last real token (the state skips
      padding after it); None: all T.

  Returns:
    (silu(conv) [B, T, C] in x's dtype, the state after x: its last K-1
    inputs, for the next call).
  """
  kernel = weight.shape[-1]
  if state is None:
    state = jnp.zeros((x.shape[0], x.shape[2], kernel - 1), x.dtype)
  full = jnp.concatenate([state.astype(x.dtype), jnp.swapaxes(x, 1, 2)],
                         axis=-1)  # [B, C, K-1+T]
  t = x.shape[1]
  windows = jnp.stack([full[..., i:i + t] for i in range(kernel)], axis=-1)
  out = jnp.einsum("bctk,ck->btc", windows.astype(jnp.float32),
                   weight.astype(jnp.float32))
  if end is None:
    return jax.nn.silu(out).astype(x.dtype), full[..., t:]
  index = end[:, None, None] + jnp.arange(kernel - 1)[None, None]
  return jax.nn.silu(out).astype(x.dtype), jnp.take_along_axis(
      full, jnp.broadcast_to(index, full.shape[:2] + (kernel - 1,)), axis=-1)


@dataclasses.dataclass(frozen=True)
class LinearAttentionDims:
  """A GatedDeltaNet layer's sizes (HF `linear_*` config fields)."""

  key_heads: int  # linear_num_key_heads
  value_heads: int  # linear_num_value_heads, a multiple of key_heads
  key_dim: int  # linear_key_head_dim
  value_dim: int  # linear_value_head_dim
  conv_kernel: int = 4  # linear_conv_kernel_dim


class GatedDeltaNet(nn.Module):
  """Qwen3.5's and Qwen3-Next's linear-attention layer (HF
  Qwen3_5GatedDeltaNet, Qwen3NextGatedDeltaNet: the same function, their
  projections fused differently; models/hf_layout.py).

  q, k, v = silu(conv(x W)) per channel (their HF `in_proj_qkv` rows and
  `conv1d` channels, split by part), beta = sigmoid(x W_b), g =
  -exp(A_log) softplus(x W_a + dt_bias); the gated delta rule (chunked, or
  one recurrent step for a single token with a state); then w * RMSNorm(o)
  * silu(x W_z) per value head and the output projection. Padding tokens
  (mask False) are zeroed first, as transformers does, and neither decay
  nor write the state; with a state, a row's real tokens are contiguous
  (after left padding: a prefill; before right padding: the sampler's
  chunks) and the conv state skips the padding after them.

  Parameters: {q,k}_proj [embed, kv_heads, head_dim], {v,z}_proj [embed,
  heads, head_dim], {b,a}_proj [embed, heads], {q,k,v}_conv [(kv_)heads,
  head_dim, K], dt_bias, A_log [heads], norm/scale [head_dim], o_proj
  [heads, head_dim, embed] (key heads under 'kv_heads', value heads under
  'heads').
  """

  config: ModelConfig
  dims: LinearAttentionDims
  chunk: int = 64

  @nn.compact
  def __call__(self, x: Array, mask: Array, state=None):
    """x [B, T, D], mask bool [B, T]; state: (S [B, Hv, Dk, Dv], conv
    states ([B, Hk*Dk, K-1] of q, of k, [B, Hv*Dv, K-1] of v)) or None
    (a sequence's start). Returns (out [B, T, D], the state after x)."""
    cfg, n = self.config, self.dims
    init = nn.initializers.normal(INIT_STD)
    d, (b, t) = cfg.hidden_size, x.shape[:2]
    x = x * mask[..., None].astype(x.dtype)
    shapes = {"q": (n.key_heads, n.key_dim, "kv_heads"),
              "k": (n.key_heads, n.key_dim, "kv_heads"),
              "v": (n.value_heads, n.value_dim, "heads")}
    convs, new_convs = {}, []
    # One past each row's last real token: its real tokens may follow
    # left padding (a prefill) or precede right padding (the sampler's
    # chunks); padding inputs are zeros, as a sequence's start state.
    end = None if state is None else jnp.max(
        jnp.where(mask, jnp.arange(t, dtype=jnp.int32) + 1, 0), axis=1)
    for j, (name, (heads, dim, axis)) in enumerate(shapes.items()):
      w = param(self, f"{name}_proj", init, (d, heads, dim),
                ("embed", axis, "head_dim"))
      y = jnp.einsum("btd,dhk->bthk", x, w.astype(x.dtype))
      c = param(self, f"{name}_conv", init, (heads, dim, n.conv_kernel),
                (axis, "head_dim", None))
      y, conv_state = causal_conv1d(
          y.reshape(b, t, heads * dim), c.reshape(heads * dim, -1),
          None if state is None else state[1][j], end)
      convs[name] = y.reshape(b, t, heads, dim)
      new_convs.append(conv_state)
    hv, dv = n.value_heads, n.value_dim
    gate = lambda name: jnp.einsum("btd,dh->bth", x, param(
        self, f"{name}_proj", init, (d, hv), ("embed", "heads")).astype(
            x.dtype)).astype(jnp.float32)
    beta = jnp.where(mask[..., None], jax.nn.sigmoid(gate("b")), 0.0)
    dt_bias = param(self, "dt_bias", nn.initializers.ones, (hv,), ("heads",))
    a_log = param(self, "A_log", nn.initializers.zeros, (hv,), ("heads",))
    g = jnp.where(mask[..., None], -jnp.exp(a_log.astype(
        jnp.float32)) * jax.nn.softplus(gate("a") + dt_bias.astype(
            jnp.float32)), 0.0)
    s0 = None if state is None else state[0]
    if t == 1 and s0 is not None:
      out, s = recurrent_gated_delta_rule(convs["q"], convs["k"], convs["v"],
                                          g, beta, s0)
    else:
      out, s = chunked_gated_delta_rule(convs["q"], convs["k"], convs["v"],
                                        g, beta, s0, self.chunk)
    z = jnp.einsum("btd,dhk->bthk", x, param(
        self, "z_proj", init, (d, hv, dv), ("embed", "heads", "head_dim")
    ).astype(x.dtype))
    scale = param(self, "norm_scale", nn.initializers.ones, (dv,),
                  ("head_dim",))
    normed = out * jax.lax.rsqrt(
        jnp.mean(out * out, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    y = (scale.astype(jnp.float32) * normed.astype(x.dtype).astype(
        jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)
    o_proj = param(self, "o_proj", init, (hv, dv, d),
                   ("heads", "head_dim", "embed"))
    return (jnp.einsum("bthk,hkd->btd", y, o_proj.astype(x.dtype)),
            (s, tuple(new_convs)))
