"""Batched multi-turn generation on the host: `Generator` and `generate`.

`Generator` drives the jitted operations of `decoding.py` for the episode
runners: it keeps each row's token history, pads chunks to power-of-two
buckets (few compilations), runs only the rows that have work (a refilled
slot's prompt, an observation, the rows still generating: `append_rows`,
`decode_rows`) and, when the parameters change, rebuilds the cache from the
histories unless the caller keeps it, so recorded log-probs come from one set
of weights over the full context. `generate()` is the one-shot convenience
for single-turn use.

For a mixture-of-experts policy it also keeps, aligned with each row's
history, the experts every token was routed to when it was first fed
(`row_experts`; routing replay, R3). A cache rebuilt under new weights does
not rewrite them: a token's record is the routing its own weights chose.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import numpy as np

from sao_jax.models.config import ModelConfig
from sao_jax.models.logprobs import unwrap_params
from sao_jax.sampler import decoding
from sao_jax.sampler import mesh as mesh_lib
from sao_jax.sampler.decoding import PAD_ID
from sao_jax.sampler.sampling import SamplingParams

Array = jax.Array
MIN_BUCKET = 8  # Default of config.sampler.min_prompt_bucket.


def bucket_length(n: int, minimum: int = MIN_BUCKET) -> int:
  """Smallest power of two >= max(n, minimum) (static shapes, few compiles)."""
  n = max(int(n), minimum, 1)
  return 1 << (n - 1).bit_length()


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
  experts: np.ndarray | None = None  # MoE: uint16 [n, M, k] (R3); else None


def rows_per_prefill(prefill_rows: int, batch_size: int) -> int:
  """Rows one prefill call feeds: ``prefill_rows`` when it is below the
  batch (``config.sampler.prefill_rows``), else the whole batch."""
  return prefill_rows if 0 < prefill_rows < batch_size else batch_size


class Generator:
  """Stateful multi-turn generation for a fixed batch of rows.

  Keeps each row's full token history on the host. Rows are fed on their own
  (only the rows with tokens to append run the model); when `set_params`
  changes the weights without keeping the cache, it is rebuilt by one
  prefill over the histories (``prefill_rows`` rows a call, if set).
  """

  def __init__(self, config: ModelConfig, params: Any, batch_size: int,
               max_len: int, sampling: SamplingParams = SamplingParams(),
               rng: Array | None = None, min_bucket: int = MIN_BUCKET,
               row_subsets: bool = True,
               mesh: mesh_lib.SamplerMesh | None = None,
               prefill_rows: int = 0):
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
      row_subsets: run only the rows with work (padded to an eighth, a
        quarter or half of the batch: three more shapes per chunk length to
        compile); False: every call runs the whole batch, masked
        (``config.sampler.row_subsets``; pays for itself only when a
        forward over the full batch costs more than compiling those shapes).
      mesh: the sampler's mesh (`sampler/mesh.py`): the weights and the
        cache are placed on it and every program runs over it; None: one
        device, or wherever the weights already are (evaluation).
      prefill_rows: the most rows one call feeds prompts or observations
        to (``config.sampler.prefill_rows``): below ``batch_size``, rows are
        fed that many a call (padded with untouched rows), bounding the
        prefill's activations; 0: as many as have tokens (the whole batch
        at once, or a subset as ``row_subsets`` says).
    """
    self.config = config
    self.batch_size = batch_size
    self.max_len = int(max_len)
    self.sampling = sampling
    self.min_bucket = int(min_bucket)
    self.row_subsets = bool(row_subsets)
    self.prefill_rows = int(prefill_rows)
    self._mesh = mesh
    self._init_state = functools.partial(decoding.init_state, config,
                                         batch_size, self.max_len)
    self._param_shardings = None
    if mesh is not None:
      self._param_shardings = mesh.param_shardings(config)
      self._init_state = jax.jit(self._init_state, out_shardings=(
          mesh.state_shardings(jax.eval_shape(self._init_state))))
    self._params = self._place(params)
    self._rng = jax.random.PRNGKey(0) if rng is None else rng
    self._history: list[list[int]] = [[] for _ in range(batch_size)]
    self._state: decoding.DecodeState | None = None
    self._moe = config.moe is not None
    # MoE only: per row, uint16 [n, M, k] chunks aligned with its history.
    self._experts: list[list[np.ndarray]] = [[] for _ in range(batch_size)]
    self.last_steps = 0  # Loop iterations of the last `generate` call.

  def _place(self, params: Any) -> Any:
    """Plain params, on the mesh if there is one."""
    params = unwrap_params(params)
    if self._mesh is None:
      return params
    return jax.device_put(params, self._param_shardings)

  @property
  def histories(self) -> list[list[int]]:
    return [list(h) for h in self._history]

  def row_experts(self, i: int) -> np.ndarray | None:
    """uint16 [len(history), M, k]: the experts each token of row ``i`` was
    routed to in each MoE layer when first fed; None for a dense policy."""
    if not self._moe:
      return None
    if not self._experts[i]:
      return np.zeros((0, self.config.num_moe_layers, self.config.moe.top_k),
                      np.uint16)
    return np.concatenate(self._experts[i])

  def routing_of(self, i: int, tokens: Sequence[int]) -> np.ndarray | None:
    """Row ``i``'s experts of ``tokens`` (uint16 [len(tokens), M, k]): its
    history, possibly followed by tokens never fed (an episode's last
    observation), which are fed now so that they are routed too; None for a
    dense policy. No token (an episode that failed at reset): empty."""
    if not self._moe or not len(tokens):
      return None if not self._moe else self.row_experts(i)[:0]
    fed = len(self._history[i])
    if fed < len(tokens):
      self.append([list(tokens[fed:]) if j == i else []
                   for j in range(self.batch_size)])
    return self.row_experts(i)[:len(tokens)]

  def _record(self, rows: Sequence[int], experts: Any,
              counts: Sequence[int], starts: Sequence[int] | None = None
              ) -> None:
    """Appends ``experts[j, start:start + counts[j]]`` (device [K, C, M, k])
    to row ``rows[j]``'s record (MoE only; one host transfer)."""
    if experts is None:
      return
    host = np.asarray(jax.device_get(experts)).astype(np.uint16)
    for j, (i, n) in enumerate(zip(rows, counts)):
      if n:
        a = 0 if starts is None else starts[j]
        self._experts[i].append(host[j, a:a + n])

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
    self._params = self._place(params)
    if not keep_cache:
      self._state = None

  def reset_rows(self, rows: Sequence[int]) -> None:
    """Forgets rows' histories and cache entries (the slots get new episodes)."""
    rows = list(rows)
    if not rows:
      return
    for i in rows:
      self._history[i] = []
      self._experts[i] = []
    if self._state is not None:
      mask = np.zeros(self.batch_size, np.bool_)
      mask[rows] = True
      with mesh_lib.maybe(self._mesh):
        self._state = decoding.clear_rows(self._state, mask)

  def _check_room(self, need: Sequence[int]) -> None:
    """Raises unless every row's history plus ``need[i]`` tokens fits."""
    for i, (h, n) in enumerate(zip(self._history, need)):
      if n and len(h) + n > self.max_len:
        raise ValueError(
            f"Generator cache too small: row {i} holds {len(h)} tokens and "
            f"needs {n} more > max_len={self.max_len}; raise max_len or lower "
            "the token limits.")

  def _rebuild(self) -> np.ndarray | Array | None:
    """Prefills a fresh cache with every row's history (one call, or
    ``prefill_rows`` rows a call); returns a MoE policy's experts of that
    prefill, [B, L, M, k] (else None)."""
    self._check_room([0] * self.batch_size)
    self._state = self._init_state()
    longest = max(len(h) for h in self._history)
    if not longest:
      return None
    length = bucket_length(longest, self.min_bucket)
    if not self._capped:
      tokens, mask = _right_pad(self._history, length)
      with mesh_lib.maybe(self._mesh):
        self._state, experts = decoding.append_chunk(
            self._params, self.config, self._state, tokens, mask)
      return experts
    out = None
    rows = [i for i, h in enumerate(self._history) if h]
    for ran, experts, group in self._feed_groups(self._history, rows):
      if experts is not None:
        host = np.asarray(jax.device_get(experts))
        if out is None:
          out = np.zeros((self.batch_size, length, *host.shape[2:]),
                         host.dtype)
        for j, i in enumerate(ran):
          if i in group:
            out[i, :host.shape[1]] = host[j]
    return out

  @property
  def _capped(self) -> bool:
    return rows_per_prefill(self.prefill_rows, self.batch_size) < (
        self.batch_size)

  def _feed_groups(self, chunks: Sequence[Sequence[int]], rows: list[int]):
    """Feeds ``chunks[i]`` of ``rows``: in one call, or ``prefill_rows``
    rows a call when capped. Yields, per call, the rows it ran, their
    experts [K, C, M, k] (MoE; else None) and the rows of ``rows`` fed."""
    b = self.batch_size
    step = self.prefill_rows if self._capped else len(rows)
    for start in range(0, len(rows), step):
      group = set(rows[start:start + step])
      length = bucket_length(max(len(chunks[i]) for i in group),
                             self.min_bucket)
      if self._capped:
        picked = sorted(group) + sorted(set(range(b)) - group)[
            :self.prefill_rows - len(group)]
      else:
        picked = self._pick(sorted(group))
      with mesh_lib.maybe(self._mesh):
        if picked is None:  # The whole batch (rows outside fed nothing).
          ran = list(range(b))
          tokens, mask = _right_pad(
              [c if i in group else [] for i, c in enumerate(chunks)], length)
          self._state, experts = decoding.append_chunk(
              self._params, self.config, self._state, tokens, mask)
        else:
          ran = picked
          tokens, mask = _right_pad(
              [chunks[i] if i in group else [] for i in picked], length)
          self._state, experts = decoding.append_rows(
              self._params, self.config, self._state,
              np.asarray(picked, np.int32), tokens, mask)
      yield ran, experts, group

  def _pick(self, rows: list[int]) -> list[int] | None:
    """``rows`` padded with other rows to an eighth, a quarter or half of
    the batch (three shapes to compile), or None when they are more than
    half or ``row_subsets`` is off (then the whole batch runs)."""
    b = self.batch_size
    if not self.row_subsets:
      return None
    k = next((k for k in (b // 8, b // 4, b // 2) if k >= len(rows)), b)
    if k == b:
      return None
    return rows + sorted(set(range(b)) - set(rows))[:k - len(rows)]

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
      experts = self._rebuild()
      # Only the new chunks' experts: earlier tokens keep their first record.
      self._record(rows, None if experts is None else np.asarray(
          jax.device_get(experts))[rows], [len(chunks[i]) for i in rows],
                   [len(self._history[i]) - len(chunks[i]) for i in rows])
      return
    for ran, experts, group in self._feed_groups(chunks, rows):
      self._record(ran, experts,
                   [len(chunks[i]) if i in group else 0 for i in ran])

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
      self._rebuild()  # Every token fed already has its experts recorded.
    steps = bucket_length(int(budget.max()) if b else 0)
    self._rng, key = jax.random.split(self._rng)
    stops = _stop_array(stop_ids, b)
    picked = self._pick([int(i) for i in np.flatnonzero(budget)])
    kw = dict(max_new_tokens=steps, sampling=self.sampling)
    with mesh_lib.maybe(self._mesh):
      if picked is None:  # Most rows generate: the whole batch runs.
        picked = list(range(b))
        self._state, out = decoding.decode(
            self._params, self.config, self._state, key, stops, act, budget,
            row_keys, **kw)
      else:  # Only the generating rows (padded with idle ones) run.
        sel = np.asarray(picked)
        self._state, out = decoding.decode_rows(
            self._params, self.config, self._state, sel, key, stops[sel],
            act[sel], budget[sel],
            None if row_keys is None else np.asarray(row_keys)[sel], **kw)
    toks, logps, count, stopped, loop_steps, experts = jax.device_get(
        (out.tokens, out.logprobs, out.num_tokens, out.stopped, out.steps,
         out.experts))
    self.last_steps = int(loop_steps)
    segments = [Segment(np.zeros(0, np.int32), np.zeros(0, np.float32), False)
                for _ in range(b)]
    if experts is not None:
      experts = np.asarray(experts).astype(np.uint16)
    for j, i in enumerate(picked):
      n = int(count[j])
      self._history[i].extend(int(t) for t in toks[j, :n])
      routed = None if experts is None else experts[j, :n].copy()
      if routed is not None and n:
        self._experts[i].append(routed)
      segments[i] = Segment(toks[j, :n].copy(), logps[j, :n].copy(),
                            bool(stopped[j]), routed)
    return segments


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
