"""Trainer-side token log-probs and entropy, full or in chunks of tokens.

The sampler records `log_softmax(logits / T)[token]` for each token it samples
(`sao_jax.sampler.sampling`); these functions compute the same quantity from a
full (cache-free) forward over the finished sequence, so the SAO importance
ratio r_t = exp(logp_t - rollout_logp_t) (docs/design/math.md "Equations",
Eq. 1) is 1 on-policy.

Two paths give the same numbers (docs/design/math.md "Chunked log-probs"):

* full (`ModelConfig.logits_chunk` = 0, the reference): the model's float32
  [B, T, V] logits, one log-softmax over the vocabulary;
* chunked (`logits_chunk` = N > 0 tokens): the model returns its final hidden
  states [B, T, D] (`Transformer(outputs='hidden')`) and `chunked_token_stats`
  projects C = max(1, N // B) positions of every row at a time (B x C ~ N
  tokens; the batch axis stays whole, so its sharding is kept) onto the
  vocabulary inside a
  `jax.checkpoint`-ed `lax.map`, keeping only the per-token results; the
  backward recomputes each chunk's logits. The largest vocabulary-sized array
  is one chunk's [B, C, V], whatever T.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import moe_outputs
from sao_jax.models.transformer import cap_logits
from sao_jax.models.transformer import output_weight
from sao_jax.models.transformer import positions_from_mask
from sao_jax.models.transformer import Transformer

Array = jax.Array
Stats = dict[str, Array]


def unwrap_params(params: Any) -> Any:
  """The plain `Transformer` params tree from params or `{'params': ...}`."""
  if "params" in params and "decoder" not in params:
    params = params["params"]
  return nn.unbox(params)


def _stats(logits: Array, targets: Array, temperature: float,
           with_entropy: bool, with_argmax: bool) -> Stats:
  """Per-token statistics of next-token logits [B, N, V] for targets [B, N].

  'logp': log_softmax(logits / T)[target]; 'entropy': -sum p log p of that
  distribution; 'argmax': its most likely token (int32).
  """
  scaled = jax.nn.log_softmax(
      logits.astype(jnp.float32) / jnp.float32(temperature), axis=-1)
  out = {"logp": jnp.take_along_axis(
      scaled, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]}
  if with_entropy:
    out["entropy"] = -(jnp.exp(scaled) * scaled).sum(-1)
  if with_argmax:
    out["argmax"] = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
  return out


def _shift(stats: Stats) -> Stats:
  """Aligns stats about token t+1 (computed at t) with token t; 0 at t = 0."""
  return {k: jnp.pad(v, ((0, 0), (1, 0))) for k, v in stats.items()}


def stats_from_logits(logits: Array, tokens: Array, temperature: float = 1.0,
                      *, with_entropy: bool = True,
                      with_argmax: bool = False) -> Stats:
  """The full path: out[k][:, t] about tokens[:, t] given its prefix.

  Args:
    logits: float [B, T, V] next-token logits (position t predicts t+1).
    tokens: int [B, T] the sequence the logits were computed on.
    temperature: the sampling temperature (> 0).
    with_entropy: also return 'entropy' [B, T].
    with_argmax: also return 'argmax' [B, T] (the predicted token).

  Returns:
    {'logp': float32 [B, T], ...} aligned with `tokens`, 0 at t = 0.
  """
  return _shift(_stats(logits[:, :-1], tokens[:, 1:], temperature,
                       with_entropy, with_argmax))


def logprobs_from_logits(logits: Array, tokens: Array,
                         temperature: float = 1.0) -> Array:
  """out[:, t] = log_softmax(logits[:, t-1] / T)[tokens[:, t]]; out[:, 0] = 0.

  float32 [B, T], aligned with `tokens` (as `Trajectory.rollout_logp`).
  """
  return stats_from_logits(logits, tokens, temperature,
                           with_entropy=False)["logp"]


def _project(x: Array, weight: Array, layout: str, softcap: float) -> Array:
  """float32 logits of hidden states x [B, C, D], as `Transformer` computes."""
  return nn.with_logical_constraint(cap_logits(
      jnp.einsum(f"bcd,{layout}->bcv", x, weight.astype(x.dtype),
                 preferred_element_type=jnp.float32).astype(jnp.float32),
      softcap), ("batch", "length", "vocab"))


def chunked_token_stats(hidden: Array, weight: Array, layout: str,
                        tokens: Array, *, chunk: int,
                        temperature: float = 1.0, with_entropy: bool = True,
                        with_argmax: bool = False,
                        softcap: float = 0.0) -> Stats:
  """`stats_from_logits` of `hidden @ weight`, `chunk` positions at a time.

  The T - 1 predicting positions are padded to a multiple of `chunk` and
  mapped over (`lax.map`); each chunk's body is `jax.checkpoint`-ed, so the
  forward keeps only its [B, chunk] results and the backward recomputes its
  [B, chunk, V] logits. With T - 1 <= chunk it is one plain piece (the full
  path's `stats_from_logits` of all T positions' logits).

  Args:
    hidden: [B, T, D] final hidden states (`Transformer(outputs='hidden')`).
    weight: the output projection, [V, D] (layout 'vd', tied) or [D, V]
      ('dv', `lm_head`); see `transformer.output_weight`.
    layout: 'vd' or 'dv'.
    tokens: int [B, T].
    chunk: positions per chunk (> 0).
    temperature: the sampling temperature (> 0).
    with_entropy: also return 'entropy'.
    with_argmax: also return 'argmax'.
    softcap: the model's `final_logit_softcapping` (0: none).

  Returns:
    As `stats_from_logits`.
  """
  if layout not in ("vd", "dv"):
    raise ValueError(f"layout={layout!r}; expected 'vd' (tied embedding) or "
                     "'dv' (lm_head).")
  if chunk <= 0:
    raise ValueError(f"chunk={chunk} must be > 0 (positions per chunk).")
  x, targets = hidden[:, :-1], tokens[:, 1:]
  batch, n, dim = x.shape

  def body(xt):
    return _stats(_project(xt[0], weight, layout, softcap), xt[1],
                  temperature, with_entropy, with_argmax)

  if n <= chunk:  # One piece: projected as the full path does (all T rows
    # in one matmul, then sliced); XLA CPU fused the projection of the
    # sliced [B, T - 1] rows into the softmax's loop, 6-11 % slower.
    return stats_from_logits(_project(hidden, weight, layout, softcap),
                             tokens, temperature, with_entropy=with_entropy,
                             with_argmax=with_argmax)
  k = -(-n // chunk)
  pad = k * chunk - n
  xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(batch, k, chunk, dim)
  ts = jnp.pad(targets, ((0, 0), (0, pad))).reshape(batch, k, chunk)
  out = jax.lax.map(jax.checkpoint(body, prevent_cse=False),
                    (xs.swapaxes(0, 1), ts.swapaxes(0, 1)))
  return _shift({key: v.swapaxes(0, 1).reshape(batch, k * chunk)[:, :n]
                 for key, v in out.items()})


def chunk_positions(config: ModelConfig, batch: int) -> int:
  """Positions per chunk: `logits_chunk` tokens over the batch's rows (>= 1)."""
  return max(1, config.logits_chunk // batch)


def policy_token_stats(params: Any, config: ModelConfig, tokens: Array,
                       positions: Array, attention_mask: Array, *,
                       temperature: float = 1.0, with_entropy: bool = True,
                       with_argmax: bool = False, **model_kwargs) -> Stats:
  """The policy's per-token stats from one forward, by `config.logits_chunk`.

  Chunked (`chunked_token_stats` on the model's hidden states, in chunks of
  `chunk_positions` positions: about `logits_chunk` tokens) when
  `logits_chunk` > 0, else the full-logits reference (`stats_from_logits`);
  the same numbers either way. `model_kwargs` go to `Transformer.__call__`.

  Args:
    params: plain `Transformer` params tree (`variables['params']`).
    config: the model config.
    tokens: int32 [B, T].
    positions: int32 [B, T].
    attention_mask: bool [B, T].
    temperature: the temperature the tokens were sampled at.
    with_entropy: also return 'entropy'.
    with_argmax: also return 'argmax'.
    **model_kwargs: further arguments of the model (e.g. segment ids).

  Returns:
    {'logp': float32 [B, T], ...}: about token t given its prefix, 0 at t = 0.
  """
  kw = dict(temperature=temperature, with_entropy=with_entropy,
            with_argmax=with_argmax)
  # A MoE policy also reports its routing: 'moe_experts', 'moe_own_experts'
  # and 'moe_aux_loss' (transformer.moe_outputs).
  hidden = config.logits_chunk > 0
  model = Transformer(config, outputs="hidden" if hidden else "logits")
  args = ({"params": params}, tokens, positions, attention_mask)
  if config.moe is None:
    (x, _), moe = model.apply(*args, **model_kwargs), {}
  else:
    (x, _), state = model.apply(*args, mutable=["moe"], **model_kwargs)
    moe = moe_outputs(state)
  if hidden:
    weight, layout = output_weight(params, config)
    stats = chunked_token_stats(x, weight, layout, tokens,
                                chunk=chunk_positions(config, tokens.shape[0]),
                                softcap=config.final_logit_softcapping, **kw)
  else:
    stats = stats_from_logits(x, tokens, **kw)
  return {**stats, **{f"moe_{k}": v for k, v in moe.items()}}


@functools.partial(jax.jit, static_argnames=("config", "temperature"))
def token_logprobs(params: Any, config: ModelConfig, tokens: Array,
                   attention_mask: Array, temperature: float = 1.0) -> Array:
  """Full-forward log-prob of every token given its prefix, float32 [B, T].

  Positions come from `positions_from_mask(attention_mask)`, as in the sampler
  (padding anywhere in a row is skipped). Entries at t = 0 and on padding are
  meaningless; mask them with the trajectory's action mask.

  Args:
    params: `Transformer` params (plain, boxed or `{'params': ...}`).
    config: the model config (`logits_chunk` picks the path).
    tokens: int32 [B, T].
    attention_mask: bool [B, T], True on real tokens.
    temperature: the temperature the tokens were sampled at.
  """
  mask = attention_mask.astype(jnp.bool_)
  return policy_token_stats(
      unwrap_params(params), config, tokens, positions_from_mask(mask), mask,
      temperature=temperature, with_entropy=False)["logp"]
