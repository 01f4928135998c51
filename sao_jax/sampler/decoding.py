"""Decoding state and its jitted operations (tunix style).

State is a `DecodeState` (KV cache, each row's next-token logits and next RoPE
position). Each row of the cache has its own write end (`KVCache.end` [B]):
a row holds exactly its own tokens, from slot 0, so rows are appended to,
emptied and refilled independently and the cache never needs compacting.
Jitted, state-donating operations act on it:

- `append_chunk`: feeds a [B, C] chunk of tokens (prompt or environment
  observation), each row's real tokens first (`mask`, right padding), into
  the cache; rows with no real token in the chunk are left as they were.
- `decode`: samples up to `max_new_tokens` tokens per row in one
  `lax.while_loop`, feeding each sampled token back into the cache (so the
  cache always holds the whole sequence, stop tokens included, ready for the
  next chunk), until every row hit a stop token or its budget.
- `append_rows` / `decode_rows`: the same for only some rows (a refilled
  slot's prompt, one row's observation, the rows still generating): their
  rows are gathered, run and put back, so the work is that of those rows.
- `clear_rows`: empties rows for new episodes.

For a mixture-of-experts policy (``config.moe``) the appends and decodes
also return the experts each fed token was routed to in each MoE layer,
int32 [B, C, M, k] (routing replay, R3: the trainer's forward reuses them);
a dense policy returns None there (no extra output, no cost).

Traced under a sampler mesh (`sampler/mesh.py`: `jax.set_mesh` and the
logical-axis rules), every operation constrains the state it returns to its
logical axes (`state_axes`, `constrain_state`): the cache split over KV
heads and rows, so consecutive calls never reshard it. Without a mesh the
constraints are no-ops.
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax import sharding
from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import init_cache
from sao_jax.models.transformer import KVCache
from sao_jax.models.transformer import moe_outputs
from sao_jax.models.transformer import Transformer
from sao_jax.sampler.sampling import sample
from sao_jax.sampler.sampling import SamplingParams

Array = jax.Array
PAD_ID = 0
WARNED: set[str] = set()  # Axes a size does not divide: logged once.


@flax.struct.dataclass
class DecodeState:
  """Generation state of a batch.

  Attributes:
    cache: KV cache holding every token fed so far.
    last_logits: float32 [B, V] logits for each row's next token.
    pos: int32 [B] RoPE position of each row's next token (= real tokens fed).
  """

  cache: KVCache
  last_logits: Array
  pos: Array


@flax.struct.dataclass
class DecodeOutput:
  """What one `decode` call sampled.

  Attributes:
    tokens: int32 [B, N]; row i's new tokens are tokens[i, :num_tokens[i]].
    logprobs: float32 [B, N] log-prob of each sampled token (see sampling.py).
    num_tokens: int32 [B] tokens sampled per row (stop token included).
    stopped: bool [B] the row ended on one of its stop tokens.
    steps: int32 scalar, iterations the loop ran (it stops once all are done).
    experts: MoE policy only (else None): int32 [B, N, M, k], the experts
      each sampled token was routed to when it was fed back (R3).
  """

  tokens: Array
  logprobs: Array
  num_tokens: Array
  stopped: Array
  steps: Array
  experts: Array | None = None


def state_axes(state: DecodeState) -> DecodeState:
  """The logical axis names of each of ``state``'s arrays (a `DecodeState`
  whose leaves are name tuples): keys/values by KV head, everything by row;
  a hybrid decoder's linear states by row only."""
  kv = ("layers", "batch", "length", "kv_heads", "head_dim")
  c = state.cache
  return DecodeState(
      cache=c.replace(
          k=kv, v=kv, valid=("batch", "length"),
          end=("batch",) if c.end.ndim else (),
          linear=None if c.linear is None else tuple(
              ("layers", "batch") + (None,) * (a.ndim - 2) for a in c.linear)),
      last_logits=("batch", "vocab"), pos=("batch",))


def is_names(x: Any) -> bool:
  """A leaf of `state_axes`: a tuple of axis names."""
  return isinstance(x, tuple) and all(n is None or isinstance(n, str)
                                      for n in x)


def constrain_state(state: DecodeState) -> DecodeState:
  """``state`` held to its logical axes under the traced-in mesh and rules
  (`sharding.logical_to_spec`: axes a size does not divide are dropped);
  unchanged where no mesh is set."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return state
  rules = tuple(nn.get_logical_axis_rules()) or None
  return jax.tree.map(
      lambda names, a: jax.lax.with_sharding_constraint(
          a, sharding.logical_to_spec(names, a.shape, mesh, rules, WARNED)),
      state_axes(state), state, is_leaf=is_names)


def init_state(config: ModelConfig, batch_size: int,
               max_len: int) -> DecodeState:
  """An empty state with `max_len` cache slots per row (per-row ends)."""
  return DecodeState(
      cache=init_cache(config, batch_size, max_len, per_row=True),
      last_logits=jnp.zeros((batch_size, config.vocab_size), jnp.float32),
      pos=jnp.zeros((batch_size,), jnp.int32))


def _forward(params, config, state: DecodeState, tokens, mask
             ) -> tuple[DecodeState, Array | None]:
  """Feeds tokens [B, C] (real where mask, each row's real tokens first) and
  updates logits, positions and each row's cache end (by its real tokens:
  the padding after them is overwritten by the next chunk). Also returns,
  for a MoE policy, the experts of each token, int32 [B, C, M, k] (None for
  a dense one)."""
  mask = mask.astype(jnp.bool_)
  positions = state.pos[:, None] + jnp.maximum(
      jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
  args = ({"params": params}, tokens, positions, mask, state.cache)
  if config.moe is None:
    (logits, cache), experts = Transformer(config).apply(*args), None
  else:
    (logits, cache), sown = Transformer(config).apply(*args, mutable=["moe"])
    experts = moe_outputs(sown)["experts"]
  cache = cache.replace(
      end=state.cache.end + jnp.sum(mask, axis=1, dtype=jnp.int32))
  # Logits after each row's last real token of the chunk.
  last = jnp.max(jnp.where(mask, jnp.arange(mask.shape[1]), -1), axis=1)
  row_logits = jnp.take_along_axis(
      logits, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]
  has_any = last >= 0
  return constrain_state(DecodeState(
      cache=cache,
      last_logits=jnp.where(has_any[:, None], row_logits, state.last_logits),
      pos=state.pos + jnp.sum(mask, axis=1, dtype=jnp.int32))), experts


@functools.partial(jax.jit, static_argnames=("config",),
                   donate_argnames=("state",))
def append_chunk(params: Any, config: ModelConfig, state: DecodeState,
                 tokens: Array, mask: Array
                 ) -> tuple[DecodeState, Array | None]:
  """Appends a [B, C] chunk (prefill or observation) to the cache.

  Requires each row's end + real tokens <= max_len (checked by `Generator`).
  Returns (new state, a MoE policy's experts [B, C, M, k] or None).
  """
  return _forward(params, config, state, tokens, mask)


def _rows_of(state: DecodeState, rows: Array) -> DecodeState:
  """The state of rows int32[K] alone (a [K]-row `DecodeState`)."""
  take = lambda x, axis: jnp.take(x, rows, axis=axis)
  cache = state.cache
  return DecodeState(
      cache=cache.replace(k=take(cache.k, 1), v=take(cache.v, 1),
                          valid=take(cache.valid, 0), end=take(cache.end, 0),
                          linear=jax.tree.map(lambda a: take(a, 1),
                                              cache.linear)),
      last_logits=take(state.last_logits, 0), pos=take(state.pos, 0))


def _put_rows(state: DecodeState, rows: Array, sub: DecodeState
              ) -> DecodeState:
  """``state`` with rows int32[K] replaced by ``sub`` (`_rows_of`'s inverse)."""
  cache = state.cache
  return DecodeState(
      cache=cache.replace(
          k=cache.k.at[:, rows].set(sub.cache.k),
          v=cache.v.at[:, rows].set(sub.cache.v),
          valid=cache.valid.at[rows].set(sub.cache.valid),
          end=cache.end.at[rows].set(sub.cache.end),
          linear=jax.tree.map(lambda a, b: a.at[:, rows].set(b), cache.linear,
                              sub.cache.linear)),
      last_logits=state.last_logits.at[rows].set(sub.last_logits),
      pos=state.pos.at[rows].set(sub.pos))


@functools.partial(jax.jit, static_argnames=("config",),
                   donate_argnames=("state",))
def append_rows(params: Any, config: ModelConfig, state: DecodeState,
                rows: Array, tokens: Array, mask: Array
                ) -> tuple[DecodeState, Array | None]:
  """`append_chunk` for rows int32[K] only (distinct; tokens/mask [K, C]);
  the experts returned are those K rows'.

  A row listed with an all-False mask is put back unchanged (bucket padding).
  """
  sub, experts = _forward(params, config, _rows_of(state, rows), tokens, mask)
  return constrain_state(_put_rows(state, rows, sub)), experts


def _decode(params: Any, config: ModelConfig, state: DecodeState, rng: Array,
           stop_ids: Array, active: Array, budget: Array,
           row_keys: Array | None = None, *, max_new_tokens: int,
           sampling: SamplingParams) -> tuple[DecodeState, DecodeOutput]:
  """Samples up to `max_new_tokens` tokens per active row (`lax.while_loop`).

  Args:
    params: plain `Transformer` params.
    config: model config.
    state: the current state (donated).
    rng: PRNG key; a fixed key gives the same tokens.
    stop_ids: int32 [B, S] stop tokens per row, padded with -1.
    active: bool [B] rows that generate (others only pass through).
    budget: int32 [B] maximum new tokens per row (<= max_new_tokens).
    row_keys: optional uint32 [B, 2] per-row keys (then `rng` is unused): a
      row's token at position p is drawn with ``fold_in(row_keys[i], p)``,
      so its tokens do not depend on which other rows share the batch.
    max_new_tokens: static buffer size and loop bound. Requires each
      active row's end + budget <= max_len (padding writes past it drop).
    sampling: sampling parameters.

  Returns:
    (new state, DecodeOutput). The loop exits as soon as every row is done.
  """
  b = state.pos.shape[0]
  active = active.astype(jnp.bool_) & (budget > 0)

  def cond(carry):
    step, _, _, _, _, _, act, _, _ = carry
    return (step < max_new_tokens) & jnp.any(act)

  def body(carry):
    step, st, key, toks, logps, count, act, stopped, experts = carry
    if row_keys is None:
      key, sub = jax.random.split(key)
    else:
      sub = jax.vmap(jax.random.fold_in)(row_keys, st.pos)
    tok, lp = sample(sub, st.last_logits, sampling)
    tok = jnp.where(act, tok, PAD_ID)
    toks = jax.lax.dynamic_update_slice(toks, tok[:, None], (0, step))
    logps = jax.lax.dynamic_update_slice(
        logps, jnp.where(act, lp, 0.0)[:, None], (0, step))
    count = count + act.astype(jnp.int32)
    is_stop = act & jnp.any(tok[:, None] == stop_ids, axis=1)
    st, routed = _forward(params, config, st, tok[:, None], act[:, None])
    if experts is not None:  # The fed token's experts [B, 1, M, k].
      experts = jax.lax.dynamic_update_slice(experts, routed, (0, step, 0, 0))
    act = act & ~is_stop & (count < budget)
    return (step + 1, st, key, toks, logps, count, act, stopped | is_stop,
            experts)

  experts = None if config.moe is None else jnp.zeros(
      (b, max_new_tokens, config.num_moe_layers, config.moe.top_k), jnp.int32)
  carry = (jnp.zeros((), jnp.int32), state, rng,
           jnp.full((b, max_new_tokens), PAD_ID, jnp.int32),
           jnp.zeros((b, max_new_tokens), jnp.float32),
           jnp.zeros((b,), jnp.int32), active, jnp.zeros((b,), jnp.bool_),
           experts)
  steps, state, _, toks, logps, count, _, stopped, experts = (
      jax.lax.while_loop(cond, body, carry))
  return state, DecodeOutput(toks, logps, count, stopped, steps, experts)


decode = functools.partial(
    jax.jit, static_argnames=("config", "max_new_tokens", "sampling"),
    donate_argnames=("state",))(_decode)


@functools.partial(
    jax.jit, static_argnames=("config", "max_new_tokens", "sampling"),
    donate_argnames=("state",))
def decode_rows(params: Any, config: ModelConfig, state: DecodeState,
                rows: Array, rng: Array, stop_ids: Array, active: Array,
                budget: Array, row_keys: Array | None = None, *,
                max_new_tokens: int, sampling: SamplingParams
                ) -> tuple[DecodeState, DecodeOutput]:
  """`decode` over rows int32[K] only (the rows that generate; the others
  leave the decode batch); stop_ids, active, budget, row_keys are [K]."""
  sub, out = _decode(params, config, _rows_of(state, rows), rng, stop_ids,
                     active, budget, row_keys, max_new_tokens=max_new_tokens,
                     sampling=sampling)
  return constrain_state(_put_rows(state, rows, sub)), out


@functools.partial(jax.jit, donate_argnames=("state",))
def clear_rows(state: DecodeState, rows: Array) -> DecodeState:
  """Empties rows bool[B] (a slot refill): no valid slot, position and end 0.

  The cleared rows' old keys/values stay in memory but are never attended to
  again (attention sees only valid slots), so a refilled slot cannot see its
  previous occupant; a hybrid policy's linear-layer states of those rows
  are zeroed (a new sequence's start).
  """
  rows = rows.astype(jnp.bool_)
  zero = lambda a: jnp.where(rows.reshape((1, -1) + (1,) * (a.ndim - 2)), 0,
                             a).astype(a.dtype)
  cache = state.cache.replace(valid=state.cache.valid & ~rows[:, None],
                              end=jnp.where(rows, 0, state.cache.end),
                              linear=jax.tree.map(zero, state.cache.linear))
  return constrain_state(DecodeState(
      cache=cache, last_logits=jnp.where(rows[:, None], 0.0,
                                         state.last_logits),
      pos=jnp.where(rows, 0, state.pos)))
