"""Batched generation: jitted chunk prefill + `lax.while_loop` decode (tunix style).

State is a `DecodeState` (KV cache, each row's next-token logits and next RoPE
position). Each row of the cache has its own write end (`KVCache.end` [B]):
a row holds exactly its own tokens, from slot 0, so rows are appended to,
emptied and refilled independently and the cache never needs compacting.
Jitted, state-donating operations act on it:

- `append_chunk`: feeds a [B, C] chunk of tokens (prompt or environment
  observation), each row's real tokens first (`mask`, right padding), into
  the cache; rows with no real token in the chunk are left as they were.
- `append_rows`: the same for only some rows (a refilled slot's prompt, one
  row's observation): their cache rows are gathered, fed and put back, so
  the work is that of those rows, not of the whole batch.
- `decode`: samples up to `max_new_tokens` tokens per row in one
  `lax.while_loop`, feeding each sampled token back into the cache (so the
  cache always holds the whole sequence, stop tokens included, ready for the
  next chunk), until every row hit a stop token or its budget.
- `clear_rows`: empties rows for new episodes.

`Generator` is the stateful host-side wrapper used by the episode runner:
chunks are padded to power-of-two buckets (few compilations), and the cache
is rebuilt from each row's token history when the parameters change (new
policy version) unless the caller keeps it, so recorded log-probs come from
one set of weights over the full context. `generate()` is the one-shot
convenience for single-turn use.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

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
    steps: int32 scalar, iterations the loop ran (it stops once all are done).
  """

  tokens: Array
  logprobs: Array
  num_tokens: Array
  stopped: Array
  steps: Array


def init_state(config: ModelConfig, batch_size: int,
               max_len: int) -> DecodeState:
  """An empty state with `max_len` cache slots per row (per-row ends)."""
  return DecodeState(
      cache=init_cache(config, batch_size, max_len, per_row=True),
      last_logits=jnp.zeros((batch_size, config.vocab_size), jnp.float32),
      pos=jnp.zeros((batch_size,), jnp.int32))


def _forward(params, config, state: DecodeState, tokens, mask) -> DecodeState:
  """Feeds tokens [B, C] (real where mask, each row's real tokens first) and
  updates logits, positions and each row's cache end (by its real tokens:
  the padding after them is overwritten by the next chunk)."""
  mask = mask.astype(jnp.bool_)
  positions = state.pos[:, None] + jnp.maximum(
      jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1, 0)
  logits, cache = Transformer(config).apply(
      {"params": params}, tokens, positions, mask, state.cache)
  cache = cache.replace(
      end=state.cache.end + jnp.sum(mask, axis=1, dtype=jnp.int32))
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

  Requires each row's end + real tokens <= max_len (checked by `Generator`).
  """
  return _forward(params, config, state, tokens, mask)


@functools.partial(jax.jit, static_argnames=("config",),
                   donate_argnames=("state",))
def append_rows(params: Any, config: ModelConfig, state: DecodeState,
                rows: Array, tokens: Array, mask: Array) -> DecodeState:
  """`append_chunk` for rows int32[K] only (distinct; tokens/mask [K, C]).

  A row listed with an all-False mask is put back unchanged (bucket padding).
  """
  take = lambda x, axis: jnp.take(x, rows, axis=axis)
  cache = state.cache
  sub = DecodeState(
      cache=cache.replace(k=take(cache.k, 1), v=take(cache.v, 1),
                          valid=take(cache.valid, 0), end=take(cache.end, 0)),
      last_logits=take(state.last_logits, 0), pos=take(state.pos, 0))
  sub = _forward(params, config, sub, tokens, mask)
  return DecodeState(
      cache=cache.replace(
          k=cache.k.at[:, rows].set(sub.cache.k),
          v=cache.v.at[:, rows].set(sub.cache.v),
          valid=cache.valid.at[rows].set(sub.cache.valid),
          end=cache.end.at[rows].set(sub.cache.end)),
      last_logits=state.last_logits.at[rows].set(sub.last_logits),
      pos=state.pos.at[rows].set(sub.pos))


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
    max_new_tokens: static buffer size and loop bound. Requires each
      active row's end + budget <= max_len (padding writes past it drop).
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
  steps, state, _, toks, logps, count, _, stopped = jax.lax.while_loop(
      cond, body, carry)
  return state, DecodeOutput(toks, logps, count, stopped, steps)


@functools.partial(jax.jit, donate_argnames=("state",))
def clear_rows(state: DecodeState, rows: Array) -> DecodeState:
  """Empties rows bool[B] (a slot refill): no valid slot, position and end 0.

  The cleared rows' old keys/values stay in memory but are never attended to
  again (attention sees only valid slots), so a refilled slot cannot see its
  previous occupant.
  """
  rows = rows.astype(jnp.bool_)
  cache = state.cache.replace(valid=state.cache.valid & ~rows[:, None],
                              end=jnp.where(rows, 0, state.cache.end))
  return DecodeState(cache=cache,
                     last_logits=jnp.where(rows[:, None], 0.0,
                                           state.last_logits),
                     pos=jnp.where(rows, 0, state.pos))


def _right_pad(rows: Sequence[Sequence[int]],
               length: int) -> tuple[np.ndarray, np.ndarray]:
  """tokens, mask [len(rows), length]: each row's tokens first, then PAD_ID."""
  tokens = np.full((len(rows), length), PAD_ID, np.int32)
  mask = np.zeros((len(rows), length), np.bool_)
  for i, row in enumerate(rows):
    if len(row) > length:
      raise ValueError(f"row {i} has {len(row)} tokens > chunk length {length}.")
    tokens[i, :len(row)] = row
    mask[i, :len(row)] = True
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

  Keeps each row's full token history on the host. Rows are fed on their own
  (only the rows with tokens to append run the model); when `set_params`
  changes the weights without keeping the cache, it is rebuilt by one
  prefill over the histories.
  """

  def __init__(self, config: ModelConfig, params: Any, batch_size: int,
               max_len: int, sampling: SamplingParams = SamplingParams(),
               rng: Array | None = None, min_bucket: int = MIN_BUCKET):
    """Args:
      config: model config.
      params: `Transformer` params (plain, boxed or `{'params': ...}`).
      batch_size: number of rows (static).
      max_len: cache slots per row; must hold the longest row history (its
        tokens, including those one decode call adds).
      sampling: sampling parameters.
      rng: PRNG key (default PRNGKey(0)).
      min_bucket: prompts and chunks are padded to powers of two of at least
        this length (``config.sampler.min_prompt_bucket``).
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
    self.last_steps = 0  # Loop iterations of the last `generate` call.

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
      keep_cache: keep the keys/values computed under the old weights for
        the tokens already fed (as PipelineRL does) instead of recomputing
        the cache under the new weights before next use.
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

  def _check_room(self, need: Sequence[int]) -> None:
    """Raises unless every row's history plus ``need[i]`` tokens fits."""
    for i, (h, n) in enumerate(zip(self._history, need)):
      if n and len(h) + n > self.max_len:
        raise ValueError(
            f"Generator cache too small: row {i} holds {len(h)} tokens and "
            f"needs {n} more > max_len={self.max_len}; raise max_len or lower "
            "the token limits.")

  def _rebuild(self) -> None:
    """Prefills a fresh cache with every row's history (one call)."""
    self._check_room([0] * self.batch_size)
    self._state = init_state(self.config, self.batch_size, self.max_len)
    longest = max(len(h) for h in self._history)
    if longest:
      tokens, mask = _right_pad(self._history,
                                bucket_length(longest, self.min_bucket))
      self._state = append_chunk(self._params, self.config, self._state,
                                 jnp.asarray(tokens), jnp.asarray(mask))

  def append(self, chunks: Sequence[Sequence[int]]) -> None:
    """Appends per-row token chunks (prompt / observations; may be empty).

    Only rows with tokens run the model (padded to a power of two with other,
    unchanged rows; the whole batch when that is over half of it).
    """
    if len(chunks) != self.batch_size:
      raise ValueError(
          f"append got {len(chunks)} chunks for batch size {self.batch_size}.")
    rows = [i for i, c in enumerate(chunks) if len(c)]
    if not rows:
      return
    self._check_room([len(c) for c in chunks])
    fresh = self._state is None
    for i in rows:
      self._history[i].extend(int(t) for t in chunks[i])
    if fresh:  # Nothing computed yet (fresh or new weights): prefill all.
      self._rebuild()
      return
    length = bucket_length(max(len(chunks[i]) for i in rows), self.min_bucket)
    k = bucket_length(len(rows), 1)
    if 2 * k > self.batch_size:
      tokens, mask = _right_pad(chunks, length)
      self._state = append_chunk(self._params, self.config, self._state,
                                 jnp.asarray(tokens), jnp.asarray(mask))
      return
    fill = sorted(set(range(self.batch_size)) - set(rows))
    picked = rows + fill[:k - len(rows)]
    tokens, mask = _right_pad(
        [chunks[i] for i in rows] + [()] * (k - len(rows)), length)
    self._state = append_rows(self._params, self.config, self._state,
                              jnp.asarray(picked, jnp.int32),
                              jnp.asarray(tokens), jnp.asarray(mask))

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
    self._check_room(budget)
    if self._state is None:
      self._rebuild()
    steps = bucket_length(int(budget.max()) if b else 0)
    self._rng, key = jax.random.split(self._rng)
    self._state, out = decode(
        self._params, self.config, self._state, key,
        jnp.asarray(_stop_array(stop_ids, b)), jnp.asarray(act),
        jnp.asarray(budget), row_keys, max_new_tokens=steps,
        sampling=self.sampling)
    toks, logps, count, stopped, loop_steps = jax.device_get(
        (out.tokens, out.logprobs, out.num_tokens, out.stopped, out.steps))
    self.last_steps = int(loop_steps)
    for i in range(b):
      self._history[i].extend(int(t) for t in toks[i, :count[i]])
    return [Segment(toks[i, :n].copy(), logps[i, :n].copy(), bool(stop))
            for i, (n, stop) in enumerate(zip(count, stopped))]


def generate(params: Any, config: ModelConfig,
             prompts: Sequence[Sequence[int]], rng: Array, *,
             max_new_tokens: int,
             sampling: SamplingParams = SamplingParams(),
             stop_ids: Sequence[Sequence[int]] | Sequence[int] = ()
             ) -> list[Segment]:
  """One-shot batched generation from token prompts (padded, bucketed)."""
  max_len = bucket_length(max(len(p) for p in prompts)) + bucket_length(
      max_new_tokens)
  gen = Generator(config, params, len(prompts), max_len, sampling, rng)
  gen.append(prompts)
  return gen.generate(stop_ids, max_new_tokens)
