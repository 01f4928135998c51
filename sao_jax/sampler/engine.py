"""The native rollout engine: episodes in slots of our own JAX decoder.

`NativeRollout` is the ``'native'`` `interface.Rollout`: continuous
batching, each trajectory out when it ends.

The sampler keeps ``sampler.num_slots`` episodes in flight in one `Generator`
(a fixed-shape KV cache of ``num_slots`` rows; docs/design/sampler.md
"Continuous batching"). One loop:

1. **Environment results.** A row whose action ended on a stop token waits,
   out of the decode batch, for its ``env.step``, which runs on a small
   thread pool (``sampler.env_threads``, each call bounded by
   ``env.step_timeout_s``), so a slow tool never stalls the other rows. Its
   observation is appended to that row's cache rows and it rejoins the batch.
2. **Refill** (``sampler.refill``). A free slot takes the next episode as soon
   as the `StalenessPolicy` admits the train step it feeds; its cache rows are
   emptied and its prompt prefilled (only the refilled rows run the model)
   while the other rows keep their state.
   With ``refill=False`` the slots are filled together and only when all are
   free: the batch leaves with its slowest episode (the batch-synchronous
   sampler).
3. **Weights** (``sampler.weight_poll_tokens``). Every that many decoded
   tokens the newest published weights are adopted between two decode
   chunks; in-flight episodes go on. The cache is kept (``sampler.kv_on_swap
   = 'keep'``, as PipelineRL: keys/values of earlier tokens stay those of
   the old weights for the rest of the episode; counted in
   ``sampler/kv_cache_stale_tokens``) or recomputed under the new weights
   (``'recompute'``, as AReaL). 0: weights change only with no episode in
   flight.
4. **Decode** one chunk of ``sampler.decode_chunk`` tokens for every row
   that is generating (one jitted ``lax.while_loop``); each token records
   the version that sampled it and its log-prob under the weights used.
5. **Finish.** An episode that ends is built into its `Trajectory` and
   handed to the `feed.EpisodeFeed`, which stamps its ``group_id`` and
   writes it to the ring at once (the rollouts of one prompt together).

The rules of an episode (prompt, turns, endings) are ``rollout.Episode``'s;
which episode starts next is the feed's. The tokens come from a `Decoder`
(`Generator`; tests plug in a scripted one).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from typing import Any, Callable, Protocol, Sequence

from absl import logging
import jax
import numpy as np

from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs.base import Environment
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import feed as feed_lib
from sao_jax.sampler import interface
from sao_jax.sampler import mesh as mesh_lib
from sao_jax.sampler import rollout
from sao_jax.sampler.generate import Generator
from sao_jax.sampler.generate import Segment


class Decoder(Protocol):
  """The token generator of the native engine (`Generator`'s methods)."""

  last_steps: int  # Loop iterations of the last `generate` call.

  def set_params(self, params: Any, keep_cache: bool = False) -> None: ...

  def reset_rows(self, rows: Sequence[int]) -> None: ...

  def append(self, chunks: Sequence[Sequence[int]]) -> None: ...

  def generate(self, stop_ids, max_new_tokens, active=None,
               row_keys=None) -> list[Segment]: ...

  def row_length(self, i: int) -> int: ...

  def routing_of(self, i: int, tokens: Sequence[int]) -> np.ndarray | None: ...


# (model_config, params, batch, max_len, sampling, rng, min_bucket,
# row_subsets, mesh, prefill_rows) -> a `Decoder`.
DecoderFactory = Callable[..., Decoder]


@dataclasses.dataclass
class _Slot:
  """One row of the decode batch and the episode it holds."""

  ep: rollout.Episode | None = None  # None: free.
  pending: list[int] | None = None  # Tokens to feed before decoding.
  future: cf.Future | None = None  # The env call in flight.

  @property
  def busy(self) -> bool:
    return self.ep is not None


class NativeRollout:
  """The ``'native'`` `interface.Rollout` (module docstring)."""

  name = "native"

  def __init__(self, settings: interface.RolloutSettings, *,
               model_config: ModelConfig, tokenizer: tok_lib.Tokenizer,
               envs: Sequence[Environment], weights: interface.WeightSource,
               stats, rng: jax.Array, decoder: DecoderFactory | None = None):
    """Args:
      settings: slots, chunks, weight polling, limits, sampling, stop tokens.
      model_config: the policy's config.
      tokenizer: encodes observations and decodes actions.
      envs: one environment per slot.
      weights: the newest published weights (polled).
      stats: a `SamplerStats` (counters updated in place).
      rng: PRNG key of the sampling noise (episode ``e``'s is folded in).
      decoder: builds the `Decoder` on the first weights (`Generator`).
    """
    opts = settings.options
    if len(envs) != opts.num_slots:
      raise ValueError(f"{len(envs)} envs for {opts.num_slots} slots.")
    self.settings, self.opts, self.limits = settings, opts, settings.limits
    self.envs, self.tokenizer, self.weights = list(envs), tokenizer, weights
    self.stats = stats
    self.stop_ids = tuple(rollout.default_stop_ids(tokenizer)
                          if settings.stop_ids is None else settings.stop_ids)
    self._model_config, self._rng = model_config, rng
    self._decoder = Generator if decoder is None else decoder
    self._gen: Decoder | None = None
    self.version: int | None = None
    self._slots = [_Slot() for _ in range(opts.num_slots)]
    self._since_poll = 0
    self._row_keys = np.zeros((opts.num_slots, 2), np.uint32)
    self._feed: feed_lib.EpisodeFeed | None = None

  # -- lifecycle and weights -------------------------------------------------
  def start(self) -> None:
    """Nothing to acquire: the decoder is built on the first weights."""

  def stop(self) -> None:
    self._gen, self.version = None, None
    self._slots = [_Slot() for _ in self._slots]

  def update_weights(self, params: Any, version: int) -> None:
    if self._gen is None:
      s, o = self.settings, self.opts
      mesh = None if o.mesh is None else mesh_lib.SamplerMesh.build(
          o.mesh, o.mesh_rules)
      self._gen = self._decoder(
          self._model_config, params, o.num_slots, self.limits.cache_len(),
          s.sampling, self._rng, self.limits.min_prompt_bucket,
          o.row_subsets, mesh, o.prefill_rows)
    else:
      keep = self.opts.kv_on_swap == "keep"
      if keep:
        self.stats.kv_cache_stale_tokens += sum(
            self._gen.row_length(i) for i, s in enumerate(self._slots)
            if s.busy)
      self._gen.set_params(params, keep_cache=keep)
      logging.log_every_n(logging.INFO, "sampler: weights %s -> %d with %d "
                          "episodes in flight.", 20, self.version, version,
                          sum(s.busy for s in self._slots))
    self.version = version

  def _poll_weights(self) -> None:
    params, version = self.weights()
    if params is not None and version != self.version:
      self.update_weights(params, version)

  # -- refill ----------------------------------------------------------------
  def _refill(self) -> None:
    feed = self._feed
    free = [i for i, s in enumerate(self._slots) if not s.busy]
    if not free:
      return
    n = feed.n_rollouts
    if not self.opts.refill:
      if len(free) < len(self._slots) or not feed.admits_ahead(
          len(self._slots)):
        return
    for start in range(0, len(free) - n + 1, n):
      first = feed.next_group()  # A prompt's rollouts start together.
      if first is None:
        return
      if not any(s.busy for s in self._slots):
        # Nothing in flight: start on the newest weights (in sync mode the
        # ones of the step just admitted).
        self._poll_weights()
      for k, i in enumerate(free[start:start + n]):
        self._start(i, first + k)

  def _start(self, i: int, episode: int) -> None:
    slot = self._slots[i]
    slot.ep = rollout.Episode(self.envs[i], self.tokenizer, self.limits,
                              episode)
    slot.future = None
    prompt = slot.ep.begin(self._feed.task(episode))
    if prompt is None:
      self._finish(i)
      return
    self._gen.reset_rows([i])
    # Episode e's noise depends on e alone (reproducible across resumes).
    self._row_keys[i] = np.asarray(jax.random.fold_in(self._rng, episode))
    slot.pending = prompt

  def _finish(self, i: int) -> None:
    """Builds the trajectory, frees the slot, hands it to the feed."""
    ep = self._slots[i].ep
    # A MoE policy's routing of every token (R3); an unfed tail is fed now.
    traj = ep.trajectory(self._gen.routing_of(i, ep.record.tokens))
    self._slots[i] = _Slot()
    self._feed.finish(ep.number, traj)

  # -- env turns -------------------------------------------------------------
  def _collect_env(self) -> None:
    for i, slot in enumerate(self._slots):
      if slot.future is None or not slot.future.done():
        continue
      future, slot.future = slot.future, None
      try:
        result = future.result()
      except Exception as e:  # pylint: disable=broad-except
        slot.ep.fail("step", e)
        self._finish(i)
        continue
      slot.pending = slot.ep.env_result(result)
      if slot.pending is None:
        self._finish(i)

  # -- decoding --------------------------------------------------------------
  def _feed_pending(self) -> None:
    chunks = [s.pending or [] for s in self._slots]
    if any(chunks):
      self._gen.append(chunks)
    for s in self._slots:
      s.pending = None

  def _decode(self, pool: cf.Executor) -> bool:
    """One decode chunk over the generating rows; False if there were none."""
    active = np.array([s.busy and s.future is None and not s.ep.over
                       for s in self._slots])
    if not active.any():
      return False
    self.stats.enter("running episodes (generation and env calls)")
    budgets = np.array([min(s.ep.turn_left, self.opts.decode_chunk)
                        if s.busy else 0 for s in self._slots], np.int32)
    segments = self._gen.generate(self.stop_ids, budgets, active,
                                  self._row_keys)
    steps = self._gen.last_steps
    self.stats.decode_row_steps += steps * len(self._slots)
    self.stats.decode_active_row_steps += sum(len(g.tokens) for g in segments)
    self._since_poll += steps
    for i, (slot, seg) in enumerate(zip(self._slots, segments)):
      if not active[i]:
        continue
      slot.ep.add_action(seg.tokens, seg.logprobs, self.version)
      then = slot.ep.after_segment(
          seg.stopped, ended=len(seg.tokens) < budgets[i])
      if then == rollout.STEP:
        slot.future = pool.submit(slot.ep.env_step, self.version)
      elif then == rollout.OVER:
        self._finish(i)
    return True

  # -- the loop --------------------------------------------------------------
  def run(self, feed: feed_lib.EpisodeFeed,
          should_stop: Callable[[], bool]) -> int:
    """Runs ``feed``'s episodes until ``should_stop()`` (`interface.Rollout`).

    Returns the number of episodes that were in flight when it stopped
    (abandoned, counted in ``episodes_aborted``; a resumed run starts them
    again).
    """
    self._feed = feed
    # Not a `with` block: stopping must not wait for a hung env call.
    pool = cf.ThreadPoolExecutor(self.opts.env_threads,
                                 thread_name_prefix="sao-env")
    try:
      while not should_stop():
        self._step(pool)
        if not feed.flush():
          break
    finally:
      # In flight, finished but unwritten, or waiting for their group.
      in_flight = feed.abandon(sum(s.busy for s in self._slots))
      self._slots = [_Slot() for _ in self._slots]
      pool.shutdown(wait=False, cancel_futures=True)
    return in_flight

  def _step(self, pool: cf.Executor) -> None:
    t0 = time.perf_counter()
    if self._gen is None:  # Nothing published yet.
      self.stats.enter("loading weights")
      self._poll_weights()
      if self._gen is None:
        time.sleep(0.01)
        return
    if (self.opts.weight_poll_tokens > 0
        and self._since_poll >= self.opts.weight_poll_tokens):
      self._poll_weights()
      self._since_poll = 0
    self._collect_env()
    self._refill()
    self._feed_pending()
    if self._decode(pool):
      self.stats.busy_s += time.perf_counter() - t0
      return
    waiting = [s.future for s in self._slots if s.future is not None]
    self.stats.enter("running episodes (generation and env calls)" if waiting
                     else "waiting for admission (the trainer's step)")
    if waiting:
      cf.wait(waiting, timeout=0.05, return_when=cf.FIRST_COMPLETED)
    else:
      time.sleep(0.002)  # Waiting for admission.
    self.stats.idle_s += time.perf_counter() - t0
