"""The sampler host process: episodes in, trajectories out through the ring.

The trainer starts it with ``multiprocessing`` *spawn* (never fork after JAX
is initialised); it has its own JAX runtime, optionally pinned to its own CPU
cores. Its loop (DESIGN §1, §4):

1. **Admission** (AReaL-style staleness bound): episode batch ``b`` feeds
   train step ``s_b = (b * sampler_batch) // train_batch``; it may start only
   when ``s_b − trainer_step ≤ max_staleness``. With ``max_staleness = 0``
   this is strict generate→train alternation (the ``sync`` mode).
2. Pick up the newest complete weights from the versioned slot (also
   between turns of multi-turn episodes, through ``ModelPolicy``).
3. Run the episodes (``run_episodes``), tasks drawn by index from a
   shuffled, repeated grain ``MapDataset``: episode ``e`` always gets task
   ``ds[e]``, so a resumed run continues exactly where the checkpoint was.
4. Publish every trajectory to the ring (blocking on backpressure).

It exits when told to (stop event), when its parent dies (checked between
waits, so an orphaned sampler never lingers), or on error (recorded in the
shared status for the trainer to report).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from typing import Any

from absl import logging

# Indices into the shared float64 stats array.
STAT_EPISODES = 0
STAT_TOKENS = 1  # Action tokens generated.
STAT_BUSY_S = 2  # Generating.
STAT_IDLE_S = 3  # Waiting for admission or ring space.
STAT_WEIGHT_LOAD_S = 4
STAT_VERSION = 5  # Newest weights version seen.
STAT_ERRORS = 6  # Episodes that ended in an env error.
STAT_ALIVE = 7  # 1 while the loop runs, 2 after a clean exit, -1 on crash.
NUM_STATS = 8


@dataclasses.dataclass
class SamplerSpec:
  """Everything the child needs (picklable; sent through spawn)."""

  config: Any  # The whole ml_collections config.
  model_config: Any  # sao_jax.models.config.ModelConfig.
  tokenizer_proto: bytes  # `serialized_proto()` of the run's tokenizer.
  ring_name: str
  lane: int
  weights_name: str
  parent_pid: int
  start_episode: int
  max_staleness: int  # Admission bound (0 in sync/group mode).
  cores: tuple[int, ...] = ()
  # The trainer's host in a multi-host run (its jax.process_index/count; the
  # sampler itself is not part of the distributed job): this sampler draws
  # only that host's shard of the prompts and fills its share of each batch.
  process_index: int = 0
  process_count: int = 1


class SamplerHandle:
  """Parent-side view of one sampler process and its shared control block."""

  def __init__(self, spec: SamplerSpec):
    ctx = mp.get_context("spawn")
    self.spec = spec
    self.trainer_step = ctx.Value("q", 0, lock=False)
    self.stop_event = ctx.Event()
    self.stats = ctx.Array("d", NUM_STATS, lock=False)
    self.process = ctx.Process(
        target=sampler_main, name=f"sao-sampler-{spec.lane}",
        args=(spec, self.trainer_step, self.stop_event, self.stats),
        daemon=True)

  def start(self) -> None:
    self.process.start()
    logging.info("Started sampler process pid %d (lane %d).",
                 self.process.pid, self.spec.lane)

  def set_trainer_step(self, step: int) -> None:
    self.trainer_step.value = int(step)

  def alive(self) -> bool:
    return self.process.is_alive()

  def check(self) -> None:
    """Raises if the sampler died without being asked to stop."""
    if not self.process.is_alive() and not self.stop_event.is_set():
      raise RuntimeError(
          f"Sampler process {self.process.pid} exited with code "
          f"{self.process.exitcode}; see its log lines above (prefixed "
          "'sampler').")

  def stop(self, timeout: float = 30.0) -> None:
    """Asks the sampler to stop, waits, then terminates/kills if needed."""
    self.stop_event.set()
    self.process.join(timeout)
    if self.process.is_alive():
      logging.warning("Sampler %d did not stop in %.0fs; terminating.",
                      self.process.pid, timeout)
      self.process.terminate()
      self.process.join(5.0)
    if self.process.is_alive():
      self.process.kill()
      self.process.join(5.0)

  def stats_dict(self) -> dict[str, float]:
    s = list(self.stats)
    return {
        "sampler/episodes": s[STAT_EPISODES],
        "sampler/action_tokens": s[STAT_TOKENS],
        "sampler/busy_s": s[STAT_BUSY_S],
        "sampler/idle_s": s[STAT_IDLE_S],
        "sampler/weight_load_s": s[STAT_WEIGHT_LOAD_S],
        "sampler/weights_version": s[STAT_VERSION],
        "sampler/env_errors": s[STAT_ERRORS],
    }


def _parent_alive(pid: int) -> bool:
  return os.getppid() == pid


def sampler_main(spec: SamplerSpec, trainer_step, stop_event, stats) -> None:
  """Entry point of the spawned sampler process."""
  if spec.cores:
    os.sched_setaffinity(0, spec.cores)
  # Heavy imports happen here, in the child, after affinity is set.
  from absl import logging as child_logging  # pylint: disable=g-import-not-at-top,reimported
  try:
    child_logging.set_verbosity(child_logging.INFO)
    _run(spec, trainer_step, stop_event, stats)
    stats[STAT_ALIVE] = 2
  except _ParentGone:
    child_logging.warning("sampler: parent %d is gone; exiting.",
                          spec.parent_pid)
    stats[STAT_ALIVE] = 2
  except BaseException:
    stats[STAT_ALIVE] = -1
    child_logging.exception("sampler: crashed.")
    raise


class _ParentGone(Exception):
  pass


def _run(spec: SamplerSpec, trainer_step, stop_event, stats) -> None:
  """The sampler loop (see module docstring)."""
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  from sao_jax import text_tokenizer  # pylint: disable=g-import-not-at-top
  from sao_jax.data import prompts as prompts_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.envs import from_config  # pylint: disable=g-import-not-at-top
  from sao_jax.ipc import codec  # pylint: disable=g-import-not-at-top
  from sao_jax.ipc import ring as ring_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.ipc import weights as weights_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.models import transformer  # pylint: disable=g-import-not-at-top
  from sao_jax.sampler import rollout  # pylint: disable=g-import-not-at-top
  from sao_jax.sampler.sampling import SamplingParams  # pylint: disable=g-import-not-at-top

  cfg = spec.config
  mcfg = spec.model_config
  tokenizer = text_tokenizer.from_serialized(spec.tokenizer_proto)
  train_tasks, _ = from_config.build_tasks(cfg.env)
  n_roll = int(cfg.sampler.n_rollouts)
  prompts_per_batch = max(1, int(cfg.sampler.batch_size) // n_roll)
  episodes_per_batch = prompts_per_batch * n_roll
  prompt_ds = prompts_lib.prompt_dataset(
      range(len(train_tasks)), seed=int(cfg.train.seed),
      shard_index=spec.process_index, shard_count=spec.process_count)
  envs = from_config.make_envs(cfg.env, train_tasks, episodes_per_batch)
  limits = rollout.RolloutLimits.from_config(cfg)
  sampling = SamplingParams(temperature=float(cfg.sampler.temperature),
                            top_p=float(cfg.sampler.top_p),
                            top_k=int(cfg.sampler.top_k))
  tok = np.zeros((1, 1), np.int32)
  template = jax.eval_shape(
      lambda: transformer.Transformer(mcfg).init(
          jax.random.PRNGKey(0), tok, tok, tok == 0))["params"]
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  template = nn.unbox(template)
  slot = weights_lib.WeightSlot.attach(spec.weights_name, template)
  writer = ring_lib.RingWriter(spec.ring_name, spec.lane,
                               timeout=float(cfg.ring.put_timeout_s))
  max_staleness = int(spec.max_staleness)
  train_batch = int(cfg.train.batch_size) // spec.process_count
  base_key = jax.random.PRNGKey(int(cfg.train.seed) + 1)
  if spec.process_count > 1:  # Each host its own sampling noise.
    base_key = jax.random.fold_in(base_key, spec.process_index)
  current = {"version": None, "params": None}

  def check_parent():
    if not _parent_alive(spec.parent_pid):
      raise _ParentGone()

  def load_weights():
    t0 = time.perf_counter()
    got = slot.read(timeout=5.0)
    if got is None:  # Nothing published yet: keep what we have.
      return current["params"], current["version"]
    version, params = got
    if version != current["version"]:
      current["version"], current["params"] = version, params
      stats[STAT_WEIGHT_LOAD_S] += time.perf_counter() - t0
      stats[STAT_VERSION] = version
    return current["params"], current["version"]

  stats[STAT_ALIVE] = 1
  episode = int(spec.start_episode)
  batch_index = episode // episodes_per_batch
  logging.info("sampler: starting at episode %d (batch %d), %d episodes per "
               "batch, max_staleness=%d, prompt shard %d of %d.", episode,
               batch_index, episodes_per_batch, max_staleness,
               spec.process_index, spec.process_count)
  try:
    while not stop_event.is_set():
      # 1. Admission: do not start work that would exceed the staleness bound.
      target_step = (episode + episodes_per_batch - 1) // train_batch
      t_idle = time.perf_counter()
      while (target_step - trainer_step.value > max_staleness
             and not stop_event.is_set()):
        check_parent()
        time.sleep(0.005)
      stats[STAT_IDLE_S] += time.perf_counter() - t_idle
      if stop_event.is_set():
        break
      check_parent()
      # 2. Newest weights.
      params, version = load_weights()
      if params is None:
        time.sleep(0.01)
        continue
      # 3. Episodes.
      t0 = time.perf_counter()
      first_prompt = episode // n_roll
      task_ids = [int(prompt_ds[first_prompt + i])
                  for i in range(prompts_per_batch) for _ in range(n_roll)]
      policy = rollout.ModelPolicy(
          mcfg, load_weights, limits.cache_len(), sampling,
          rng=jax.random.fold_in(base_key, batch_index))
      trajs = rollout.run_episodes(policy, envs, task_ids, tokenizer, limits)
      stats[STAT_BUSY_S] += time.perf_counter() - t0
      # 4. Publish.
      t_idle = time.perf_counter()
      for i, traj in enumerate(trajs):
        if n_roll > 1:
          traj.group_id = first_prompt + i // n_roll
        while True:
          try:
            writer.write(*codec.encode(traj), timeout=1.0)
            break
          except ring_lib.RingFullError:
            check_parent()
            if stop_event.is_set():
              return
        stats[STAT_TOKENS] += traj.num_action_tokens
        stats[STAT_ERRORS] += int(traj.error != "")
      stats[STAT_IDLE_S] += time.perf_counter() - t_idle
      stats[STAT_EPISODES] += len(trajs)
      episode += episodes_per_batch
      batch_index += 1
  finally:
    writer.close()
    slot.close()
    logging.info("sampler: stopped after %d episodes.",
                 int(stats[STAT_EPISODES]))
