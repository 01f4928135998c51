"""Batched generation: jitted chunk prefill + `lax.while_loop` decode (tunix style).

State is a `DecodeState` (KV cache, each row's next-token logits and next RoPE
position). Two jitted, state-donating operations act on it:

- `append_chunk`: feeds a [B, C] chunk of tokens (prompt or environment
  observation), padding anywhere (`mask`), into the cache; rows with no real
  token in the chunk keep their previous next-token logits.
- `decode`: samples up to `max_new_tokens` tokens per row in one
  `lax.while_loop`, feeding each sampled token back into the cache (so the
  cache always holds the whole sequence, stop tokens included, ready for the
  next chunk), until every row hit a stop token or its budget.

`Generator` is the stateful host-side wrapper used by the episode runner:
prompts/chunks are left-padded to power-of-two buckets (few compilations),
and the cache is rebuilt from each row's token history when it runs out of
slots or when the parameters change (new policy version), so recorded
log-probs always come from one set of weights over the full context.
`generate()` is the one-shot convenience for single-turn use.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

from absl import logging
import flax
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.config import ModelConfig
from sao_jax.models.logprobs import unwrap_params
from sao_jax.models.transformer import init_cache
from sao_jax.models.transformer import KVCache
from sao_jax.models.transformer import Transformer
from sao_jax.sampler.sampling import sample
from sao_jax.sampler.sampling import SamplingParams

Array = jax.Array
PAD_ID = 0
MIN_BUCKET = 8  # Default of config.sampler.min_prompt_bucket.


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
  """Smallest power of two >= max(n, minimum) (static shapes, few compiles)."""
  n = max(int(n), minimum, 1)
  return 1 << (n - 1).bit_length()


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
  """

  tokens: Array
  logprobs: Array
  num_tokens: Array
  stopped: Array


def init_state(config: ModelConfig, batch_size: int,
               max_len: int) -> DecodeState:
  """An empty state with `max_len` cache slots per row."""
  return DecodeState(
      cache=init_cache(config, batch_size, max_len),
      last_logits=jnp.zeros((batch_size, config.vocab_size), jnp.float32),
      pos=jnp.zeros((batch_size,), jnp.int32))


def _forward(params, config, state: DecodeState, tokens, mask) -> DecodeState:
  """Feeds tokens [B, C] (valid where mask) and updates logits and positions."""
  mask = mask.astype(jnp.bool_)
  positions = state.pos[:, None] + jnp.maximum(
      jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
  logits, cache = Transformer(config).apply(
      {"params": params}, tokens, positions, mask, state.cache)
  # Logits after each row's last real token of the chunk.
  last = jnp.max(jnp.where(mask, jnp.arange(mask.shape[1]), -1), axis=1)
  row_logits = jnp.take_along_axis(
      logits, jnp.maximum(last, 0)[:, None, None], axis=1)[:, 0]
  has_any = last >= 0
  return DecodeState(
      cache=cache,
      last_logits=jnp.where(has_any[:, None], row_logits, state.last_logits),
      pos=state.pos + jnp.sum(mask, axis=1, dtype=jnp.int32))


@functools.partial(jax.jit, static_argnames=("config",),
                   donate_argnames=("state",))
def append_chunk(params: Any, config: ModelConfig, state: DecodeState,
                 tokens: Array, mask: Array) -> DecodeState:
  """Appends a [B, C] chunk (prefill or observation) to the cache.

  Requires `state.cache.end + C <= max_len` (checked by `Generator`).
  """
  return _forward(params, config, state, tokens, mask)


@functools.partial(
    jax.jit, static_argnames=("config", "max_new_tokens", "sampling"),
    donate_argnames=("state",))
def decode(params: Any, config: ModelConfig, state: DecodeState, rng: Array,
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
    max_new_tokens: static buffer size and loop bound. Requires
      `state.cache.end + max_new_tokens <= max_len`.
    sampling: sampling parameters.

  Returns:
    (new state, DecodeOutput). The loop exits as soon as every row is done.
  """
  b = state.pos.shape[0]
  active = active.astype(jnp.bool_) & (budget > 0)

  def cond(carry):
    step, _, _, _, _, _, act, _ = carry
    return (step < max_new_tokens) & jnp.any(act)

  def body(carry):
    step, st, key, toks, logps, count, act, stopped = carry
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
    st = _forward(params, config, st, tok[:, None], act[:, None])
    act = act & ~is_stop & (count < budget)
    return step + 1, st, key, toks, logps, count, act, stopped | is_stop

  carry = (jnp.zeros((), jnp.int32), state, rng,
           jnp.full((b, max_new_tokens), PAD_ID, jnp.int32),
           jnp.zeros((b, max_new_tokens), jnp.float32),
           jnp.zeros((b,), jnp.int32), active, jnp.zeros((b,), jnp.bool_))
  _, state, _, toks, logps, count, _, stopped = jax.lax.while_loop(
      cond, body, carry)
  return state, DecodeOutput(toks, logps, count, stopped)


@functools.partial(jax.jit, donate_argnames=("state",))
def clear_rows(state: DecodeState, rows: Array) -> DecodeState:
  """Empties rows bool[B] (a slot refill): no valid slot, position 0.

  The cleared rows' old keys/values stay in memory but are never attended to
  again (attention sees only valid slots), so a refilled slot cannot see its
  previous occupant.
  """
  rows = rows.astype(jnp.bool_)
  cache = state.cache.replace(valid=state.cache.valid & ~rows[:, None])
  return DecodeState(cache=cache,
                     last_logits=jnp.where(rows[:, None], 0.0,
                                           state.last_logits),
                     pos=jnp.where(rows, 0, state.pos))


def _left_pad(rows: Sequence[Sequence[int]],
              length: int) -> tuple[np.ndarray, np.ndarray]:
  tokens = np.full((len(rows), length), PAD_ID, np.int32)
  mask = np.zeros((len(rows), length), np.bool_)
  for i, row in enumerate(rows):
    if len(row) > length:
      raise ValueError(f"row {i} has {len(row)} tokens > chunk length {length}.")
    if len(row):
      tokens[i, length - len(row):] = row
      mask[i, length - len(row):] = True
  return tokens, mask


def _stop_array(stop_ids: Sequence[Sequence[int]] | Sequence[int],
                batch_size: int) -> np.ndarray:
  """int32 [B, S] from one shared list or one list per row (pad -1)."""
  rows = list(stop_ids)
  if not rows or not isinstance(rows[0], (list, tuple, np.ndarray)):
    rows = [list(rows)] * batch_size
  if len(rows) != batch_size:
    raise ValueError(
        f"stop_ids has {len(rows)} rows for batch size {batch_size}; pass one "
        "list shared by all rows or one list per row.")
  width = max(1, max(len(r) for r in rows))
  out = np.full((batch_size, width), -1, np.int32)
  for i, r in enumerate(rows):
    out[i, :len(r)] = r
  return out


@dataclasses.dataclass
class Segment:
  """Tokens one row sampled in one `Generator.generate` call."""

  tokens: np.ndarray  # int32 [n]
  logprobs: np.ndarray  # float32 [n]
  stopped: bool  # ended on a stop token (else: budget exhausted / inactive)


class Generator:
  """Stateful multi-turn generation for a fixed batch of rows.

  Keeps each row's full token history on the host; when the cache runs out of
  slots or `set_params` changes the weights, the cache is rebuilt by one
  prefill over the histories (left-padded to a power-of-two bucket).
  """

  def __init__(self, config: ModelConfig, params: Any, batch_size: int,
               max_len: int, sampling: SamplingParams = SamplingParams(),
               rng: Array | None = None, min_bucket: int = MIN_BUCKET):
    """Args:
      config: model config.
      params: `Transformer` params (plain, boxed or `{'params': ...}`).
      batch_size: number of rows (static).
      max_len: cache slots per row; must hold the longest row history plus
        one decode call's `max_new_tokens` plus one chunk bucket.
      sampling: sampling parameters.
      rng: PRNG key (default PRNGKey(0)).
      min_bucket: prompts and chunks are left-padded to powers of two of at
        least this length (``config.sampler.min_prompt_bucket``).
    """
    self.config = config
    self.batch_size = batch_size
    self.max_len = int(max_len)
    self.sampling = sampling
    self.min_bucket = int(min_bucket)
    self._params = unwrap_params(params)
    self._rng = jax.random.PRNGKey(0) if rng is None else rng
    self._history: list[list[int]] = [[] for _ in range(batch_size)]
    self._state: DecodeState | None = None
    self._end = 0  # Host copy of cache.end.

  @property
  def histories(self) -> list[list[int]]:
    return [list(h) for h in self._history]

  def row_length(self, i: int) -> int:
    """Tokens of row ``i`` held in the cache (its history)."""
    return len(self._history[i])

  def set_params(self, params: Any, keep_cache: bool = False) -> None:
    """Switches weights.

    Args:
      params: the new weights.
      keep_cache: keep the keys/values computed under the old weights (as
        PipelineRL does; they are recomputed at the next compaction) instead
        of recomputing the cache under the new weights before next use.
    """
    self._params = unwrap_params(params)
    if not keep_cache:
      self._state = None

  def reset_rows(self, rows: Sequence[int]) -> None:
    """Forgets rows' histories and cache entries (the slots get new episodes)."""
    rows = list(rows)
    if not rows:
      return
    for i in rows:
      self._history[i] = []
    if self._state is not None:
      mask = np.zeros(self.batch_size, np.bool_)
      mask[rows] = True
      self._state = clear_rows(self._state, jnp.asarray(mask))

  def _rebuild(self, extra: int) -> None:
    """Re-prefills the cache from the histories, leaving `extra` free slots."""
    longest = max(len(h) for h in self._history)
    length = bucket_length(longest, self.min_bucket)
    if length + extra > self.max_len:
      raise ValueError(
          f"Generator cache too small: histories need {length} slots (longest "
          f"row {longest} tokens) plus {extra} for the next call > max_len="
          f"{self.max_len}; raise max_len or lower the token limits.")
    self._state = init_state(self.config, self.batch_size, self.max_len)
    self._end = 0
    if longest:
      tokens, mask = _left_pad(self._history, length)
      self._state = append_chunk(self._params, self.config, self._state,
                                 jnp.asarray(tokens), jnp.asarray(mask))
      self._end = length

  def _ensure(self, extra: int) -> None:
    if self._state is None or self._end + extra > self.max_len:
      if self._state is not None:
        logging.info("Generator: compacting the KV cache (end=%d, need %d).",
                     self._end, extra)
      self._rebuild(extra)

  def append(self, chunks: Sequence[Sequence[int]]) -> None:
    """Appends per-row token chunks (prompt / observations; may be empty)."""
    if len(chunks) != self.batch_size:
      raise ValueError(
          f"append got {len(chunks)} chunks for batch size {self.batch_size}.")
    longest = max(len(c) for c in chunks)
    if not longest:
      return
    length = bucket_length(longest, self.min_bucket)
    if self._state is None:
      # Nothing computed yet (fresh or new weights): prefill history + chunk.
      for h, c in zip(self._history, chunks):
        h.extend(int(t) for t in c)
      self._ensure(0)
      return
    self._ensure(length)
    tokens, mask = _left_pad(chunks, length)
    self._state = append_chunk(self._params, self.config, self._state,
                               jnp.asarray(tokens), jnp.asarray(mask))
    self._end += length
    for h, c in zip(self._history, chunks):
      h.extend(int(t) for t in c)

  def generate(self, stop_ids: Sequence[Sequence[int]] | Sequence[int],
               max_new_tokens: int | Sequence[int],
               active: Sequence[bool] | None = None,
               row_keys: Array | None = None) -> list[Segment]:
    """Samples from every active row until a stop token or its budget.

    Args:
      stop_ids: stop tokens shared by all rows, or one list per row.
      max_new_tokens: budget shared by all rows, or one per row.
      active: rows that generate (default: all).
      row_keys: optional uint32 [B, 2] per-row PRNG keys (`decode`).

    Returns:
      One `Segment` per row (empty for inactive rows).
    """
    b = self.batch_size
    budget = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (b,)).copy()
    act = np.ones(b, np.bool_) if active is None else np.asarray(active, bool)
    budget = np.where(act, budget, 0)
    if not budget.any():
      return [Segment(np.zeros(0, np.int32), np.zeros(0, np.float32), False)
              for _ in range(b)]
    steps = bucket_length(int(budget.max()) if b else 0)
    self._ensure(steps)
    self._rng, key = jax.random.split(self._rng)
    self._state, out = decode(
        self._params, self.config, self._state, key,
        jnp.asarray(_stop_array(stop_ids, b)), jnp.asarray(act),
        jnp.asarray(budget), row_keys, max_new_tokens=steps,
        sampling=self.sampling)
    toks, logps, count, stopped, end = jax.device_get(
        (out.tokens, out.logprobs, out.num_tokens, out.stopped,
         self._state.cache.end))
    self._end = int(end)
    segments = []
    for i in range(b):
      n = int(count[i])
      self._history[i].extend(int(t) for t in toks[i, :n])
      segments.append(Segment(toks[i, :n].copy(), logps[i, :n].copy(),
                              bool(stopped[i])))
    return segments


def generate(params: Any, config: ModelConfig,
             prompts: Sequence[Sequence[int]], rng: Array, *,
             max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(),
             stop_ids: Sequence[Sequence[int]] | Sequence[int] = ()
             ) -> list[Segment]:
  """One-shot batched generation from token prompts (left-padded, bucketed)."""
  max_len = bucket_length(max(len(p) for p in prompts)) + bucket_length(
      max_new_tokens)
  gen = Generator(config, params, len(prompts), max_len, sampling, rng)
  gen.append(prompts)
  return gen.generate(stop_ids, max_new_tokens)
