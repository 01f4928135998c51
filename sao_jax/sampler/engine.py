"""Continuous batching: episodes in slots, each trajectory out when it ends.

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
5. **Finish.** An episode that ends is built into its `Trajectory`, stamped
   with its ``group_id`` (its prompt draw, unique across hosts) and written
   to the ring at once (the `Outbox`; the rollouts of one prompt go
   together when ``n_rollouts > 1``).

Episode ``e`` always gets the task of prompt draw ``e // n_rollouts``, so a
resumed run continues with the same prompts (a task whose prompt alone is
over ``max_total_tokens`` is skipped at selection for the same draw of a later
epoch and counted in ``sampler/skipped_long_prompts``: `FittingPrompts`).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from typing import Any, Callable, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.data.trajectory import EpisodeRecord
from sao_jax.data.trajectory import FinishReason
from sao_jax.data.trajectory import StalenessPolicy
from sao_jax.data.trajectory import Trajectory
from sao_jax.envs.base import Environment
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import rollout
from sao_jax.sampler.generate import Generator
from sao_jax.sampler.sampling import SamplingParams

KV_ON_SWAP = ("keep", "recompute")


@dataclasses.dataclass(frozen=True)
class EngineOptions:
  """How the slots run (``config.sampler``; see the module docstring)."""

  num_slots: int = 8
  decode_chunk: int = 16
  weight_poll_tokens: int = 32
  refill: bool = True
  kv_on_swap: str = "keep"
  env_threads: int = 4
  n_rollouts: int = 1
  row_subsets: bool = True

  def __post_init__(self):
    if self.kv_on_swap not in KV_ON_SWAP:
      raise ValueError(f"sampler.kv_on_swap={self.kv_on_swap!r}: expected one "
                       f"of {KV_ON_SWAP}.")
    if self.num_slots < 1 or self.decode_chunk < 1 or self.env_threads < 1:
      raise ValueError(
          f"sampler.num_slots={self.num_slots}, decode_chunk="
          f"{self.decode_chunk}, env_threads={self.env_threads}: each must "
          "be >= 1.")
    if self.num_slots % self.n_rollouts:
      raise ValueError(
          f"sampler.num_slots={self.num_slots} is not a multiple of "
          f"sampler.n_rollouts={self.n_rollouts}.")

  @classmethod
  def from_config(cls, config: Any) -> "EngineOptions":
    s = config.sampler
    return cls(num_slots=rollout.num_slots(config),
               decode_chunk=int(s.decode_chunk),
               weight_poll_tokens=int(s.weight_poll_tokens),
               refill=bool(s.refill), kv_on_swap=str(s.kv_on_swap),
               env_threads=int(s.env_threads), n_rollouts=int(s.n_rollouts),
               row_subsets=bool(s.row_subsets))


class Outbox:
  """Writes finished trajectories to the ring (blocking on backpressure).

  ``outbox(trajs) -> bool``: False when told to stop while waiting for
  space; the trajectories written are removed from ``trajs``. The one place a
  trajectory is encoded and handed to the ring.
  """

  def __init__(self, writer, stats, should_stop: Callable[[], bool]):
    self._writer, self._stats, self._should_stop = writer, stats, should_stop

  def __call__(self, trajs: list[Trajectory]) -> bool:
    from sao_jax.data import trajectory as codec  # pylint: disable=g-import-not-at-top
    from sao_jax.ipc import ring as ring_lib  # pylint: disable=g-import-not-at-top

    t_idle = time.perf_counter()
    self._stats.enter("waiting for ring space")
    try:
      while trajs:
        try:
          self._writer.write(*codec.encode(trajs[0]), timeout=1.0)
          del trajs[0]
        except ring_lib.RingFullError:
          if self._should_stop():
            return False
    finally:
      self._stats.idle_s += time.perf_counter() - t_idle
    return True


@dataclasses.dataclass
class _Slot:
  """One row of the decode batch and the episode it holds."""

  episode: int = -1  # -1: free.
  record: EpisodeRecord | None = None
  turns: int = 0
  turn_left: int = 0  # Tokens the current action may still take.
  action: list[int] = dataclasses.field(default_factory=list)
  pending: list[int] | None = None  # Tokens to feed before decoding.
  future: cf.Future | None = None  # The env call in flight.

  @property
  def busy(self) -> bool:
    return self.episode >= 0


def _env_turn(env: Environment, tokenizer: tok_lib.Tokenizer,
              action: list[int], version: int, timeout_s: float):
  """``env.step`` on the action; (obs tokens, reward, done). Pool thread."""
  env.set_policy_version(version)
  text = tokenizer.decode(action)
  obs, reward, done, _ = rollout.call_with_timeout(
      lambda: env.step(text), timeout_s, "env.step")
  obs_tokens = [] if done else rollout.encode_observation(obs, tokenizer)
  return obs_tokens, float(reward), bool(done)


class SlotEngine:
  """The continuous-batching episode loop (module docstring)."""

  def __init__(self, *, model_config: ModelConfig, options: EngineOptions,
               limits: rollout.RolloutLimits, sampling: SamplingParams,
               tokenizer: tok_lib.Tokenizer, envs: Sequence[Environment],
               task_of: Callable[[int], Any],
               weights: Callable[[], tuple[Any, int | None]],
               staleness: StalenessPolicy, train_batch: int,
               trainer_step: Callable[[], int], outbox: Callable[..., bool],
               stats, rng: jax.Array, process_index: int = 0,
               process_count: int = 1,
               stop_ids: Sequence[int] | None = None):
    """Args:
      model_config: the policy's config.
      options: slots, chunking, refill, weight polling.
      limits: turn and token limits.
      sampling: sampling parameters.
      tokenizer: encodes observations and decodes actions.
      envs: one environment per slot.
      task_of: prompt draw index -> task for ``env.reset`` (the sampler's
        skips tasks whose prompt cannot fit: ``prompts.FittingPrompts``).
      weights: () -> (params, version) of the newest weights (None before
        the first publication).
      staleness: admission bound (an episode starts only if the train step
        it feeds is admitted).
      train_batch: this host's trajectories per train step.
      trainer_step: () -> the trainer's current step.
      outbox: writes a list of trajectories; False means stop.
      stats: a `SamplerStats` (counters updated in place).
      rng: PRNG key of the sampling noise.
      process_index, process_count: this host (group ids unique across hosts).
      stop_ids: tokens that end an action (default: the tokenizer's).
    """
    if len(envs) != options.num_slots:
      raise ValueError(f"{len(envs)} envs for {options.num_slots} slots.")
    self.opts, self.limits, self.envs = options, limits, list(envs)
    self.tokenizer, self.task_of, self.weights = tokenizer, task_of, weights
    self.staleness, self.train_batch = staleness, int(train_batch)
    self.trainer_step, self.outbox, self.stats = trainer_step, outbox, stats
    self.process_index, self.process_count = process_index, process_count
    self.stop_ids = tuple(rollout.default_stop_ids(tokenizer)
                          if stop_ids is None else stop_ids)
    self._model_config, self._sampling, self._rng = model_config, sampling, rng
    self._gen: Generator | None = None
    self.version: int | None = None
    self._slots = [_Slot() for _ in range(options.num_slots)]
    self._groups: dict[int, list[tuple[int, Trajectory]]] = {}
    self._since_poll = 0
    self._skip: frozenset[int] = frozenset()
    self._row_keys = np.zeros((options.num_slots, 2), np.uint32)
    self._ready: list[Trajectory] = []
    self.next_episode = 0

  # -- weights ---------------------------------------------------------------
  def _poll_weights(self) -> None:
    params, version = self.weights()
    if params is None or version == self.version:
      return
    if self._gen is None:
      self._gen = Generator(self._model_config, params, self.opts.num_slots,
                            self.limits.cache_len(), self._sampling,
                            self._rng, self.limits.min_prompt_bucket,
                            self.opts.row_subsets)
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

  # -- admission and refill --------------------------------------------------
  def _admits(self, episode: int) -> bool:
    return self.staleness.admits(episode // self.train_batch,
                                 self.trainer_step())

  def _refill(self) -> None:
    free = [i for i, s in enumerate(self._slots) if not s.busy]
    if not free:
      return
    n = self.opts.n_rollouts
    if not self.opts.refill:
      if len(free) < len(self._slots) or not self._admits(
          self.next_episode + len(self._slots) - 1):
        return
    for start in range(0, len(free) - n + 1, n):
      while self.next_episode in self._skip:
        self.next_episode += n
      # A prompt's rollouts start together (one group, one admission).
      if not self._admits(self.next_episode + n - 1):
        return
      if not any(s.busy for s in self._slots):
        # Nothing in flight: start on the newest weights (in sync mode the
        # ones of the step just admitted).
        self._poll_weights()
      for i in free[start:start + n]:
        self._start(i, self.next_episode)
        self.next_episode += 1

  def _start(self, i: int, episode: int) -> None:
    slot, env = self._slots[i], self.envs[i]
    slot.episode, slot.record, slot.turns = episode, EpisodeRecord(), 0
    slot.action, slot.future = [], None
    task = self.task_of(episode // self.opts.n_rollouts)
    try:
      prompt = rollout.prompt_tokens(env, task, self.tokenizer, self.limits)
      if len(prompt) >= self.limits.max_total_tokens:
        raise ValueError(f"prompt has {len(prompt)} tokens >= "
                         f"max_total_tokens={self.limits.max_total_tokens}")
    except Exception as e:  # pylint: disable=broad-except
      self._fail(i, "reset", e)
      return
    slot.record.add(prompt, 0)
    self._gen.reset_rows([i])
    # Episode e's noise depends on e alone (reproducible across resumes).
    self._row_keys[i] = np.asarray(jax.random.fold_in(self._rng, episode))
    self._next_turn(i, prompt)

  def _next_turn(self, i: int, chunk: list[int]) -> None:
    slot = self._slots[i]
    slot.pending = chunk
    slot.action = []
    slot.turn_left = rollout.action_budget(self.envs[i], self.limits,
                                           len(slot.record.tokens))

  # -- episode ends ----------------------------------------------------------
  def _fail(self, i: int, what: str, e: Exception) -> None:
    slot = self._slots[i]
    slot.record.finish = FinishReason.ERROR
    slot.record.error = f"{what}: {type(e).__name__}: {e}"
    logging.warning("sampler: episode %d (%s) failed in %s", slot.episode,
                    self.envs[i].name, slot.record.error)
    self._finish(i)

  def _finish(self, i: int) -> None:
    """Builds the trajectory, frees the slot, writes the group when whole."""
    slot = self._slots[i]
    # A MoE policy's routing of every token (R3); an unfed tail is fed now.
    rollout.attach_experts(slot.record, self._gen.routing_of(
        i, slot.record.tokens))
    traj = slot.record.trajectory(self.envs[i])
    draw = slot.episode // self.opts.n_rollouts
    traj.group_id = draw * self.process_count + self.process_index
    group = self._groups.setdefault(draw, [])
    group.append((slot.episode, traj))
    self._slots[i] = _Slot()
    if len(group) == self.opts.n_rollouts:
      del self._groups[draw]
      self._ready.extend(t for _, t in sorted(group, key=lambda g: g[0]))

  def _flush(self) -> bool:
    if not self._ready:
      return True
    trajs = list(self._ready)
    ok = self.outbox(self._ready)  # `Outbox` removes what it wrote.
    if ok:
      self._ready = []
    for traj in trajs[:len(trajs) - len(self._ready)]:
      self.stats.action_tokens += traj.num_action_tokens
      self.stats.env_errors += int(traj.error != "")
      self.stats.episodes += 1
    return ok

  # -- env turns -------------------------------------------------------------
  def _collect_env(self) -> None:
    for i, slot in enumerate(self._slots):
      if slot.future is None or not slot.future.done():
        continue
      future, slot.future = slot.future, None
      try:
        obs_tokens, reward, done = future.result()
      except Exception as e:  # pylint: disable=broad-except
        self._fail(i, "step", e)
        continue
      record = slot.record
      if slot.action:
        record.rewards[-1] += reward
      if done:
        record.finish = FinishReason.STOP
      elif len(record.tokens) + len(obs_tokens) >= self.limits.max_total_tokens:
        record.finish = FinishReason.LENGTH
      else:
        record.add(obs_tokens, 0)
        if slot.turns < self.limits.max_turns:
          self._next_turn(i, obs_tokens)
          continue
      self._finish(i)

  # -- decoding --------------------------------------------------------------
  def _feed(self) -> None:
    chunks = [s.pending or [] for s in self._slots]
    if any(chunks):
      self._gen.append(chunks)
    for s in self._slots:
      s.pending = None

  def _decode(self, pool: cf.Executor) -> bool:
    """One decode chunk over the generating rows; False if there were none."""
    active = np.array([s.busy and s.future is None and s.record.finish is None
                       for s in self._slots])
    if not active.any():
      return False
    self.stats.enter("running episodes (generation and env calls)")
    budgets = np.array([min(s.turn_left, self.opts.decode_chunk)
                        for s in self._slots], np.int32)
    segments = self._gen.generate(self.stop_ids, budgets, active,
                                  jnp.asarray(self._row_keys))
    steps = self._gen.last_steps
    self.stats.decode_row_steps += steps * len(self._slots)
    self.stats.decode_active_row_steps += sum(len(g.tokens) for g in segments)
    self._since_poll += steps
    for i, (slot, seg) in enumerate(zip(self._slots, segments)):
      if not active[i]:
        continue
      slot.record.add(seg.tokens, 1, seg.logprobs, self.version)
      slot.action.extend(int(t) for t in seg.tokens)
      slot.turn_left -= len(seg.tokens)
      if seg.stopped or (slot.turn_left <= 0
                         and self.envs[i].fixed_length_actions):
        slot.turns += 1
        slot.future = pool.submit(
            _env_turn, self.envs[i], self.tokenizer, list(slot.action),
            self.version, self.limits.step_timeout_s)
      elif slot.turn_left <= 0:
        slot.record.finish = FinishReason.LENGTH
        self._finish(i)
    return True

  # -- the loop --------------------------------------------------------------
  def run(self, start_episode: int, should_stop: Callable[[], bool],
          skip: frozenset[int] = frozenset()) -> int:
    """Runs episodes from ``start_episode`` until ``should_stop()``.

    Args:
      start_episode: the first episode to start.
      should_stop: polled once per loop iteration.
      skip: episodes not to start again (written before a stop; with
        ``n_rollouts > 1`` whole groups).

    Returns the number of episodes that were in flight when it stopped
    (abandoned, counted in ``episodes_aborted``; a resumed run starts them
    again).
    """
    self.next_episode, self._skip = int(start_episode), skip
    # Not a `with` block: stopping must not wait for a hung env call.
    pool = cf.ThreadPoolExecutor(self.opts.env_threads,
                                 thread_name_prefix="sao-env")
    try:
      while not should_stop():
        self._step(pool)
        if not self._flush():
          break
    finally:
      # In flight, finished but unwritten, or waiting for their group.
      in_flight = (sum(s.busy for s in self._slots) + len(self._ready)
                   + sum(len(g) for g in self._groups.values()))
      self.stats.episodes_aborted += in_flight
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
    self._feed()
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
