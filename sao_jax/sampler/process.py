"""The sampler host process: episodes in, trajectories out through the ring.

The trainer starts it with ``multiprocessing`` *spawn* (never fork after JAX
is initialised); it has its own JAX runtime, optionally pinned to its own CPU
cores. It is the process lifecycle only: spawn, affinity, signals and the
parent watch, the shared counters (`SamplerStats`), adopting published
weights (`_NewestWeights`) and running the `interface.Rollout` engine that
``sampler.engine`` names (``factory.make_rollout``), which holds the
episodes and writes each trajectory to the ring when it ends (a trajectory's
data path does not pass through this file; docs/design/data_path.md "File by
file").

It exits when told to (stop event), when its parent dies (the kernel kills
it, ``PR_SET_PDEATHSIG``, even inside a hung environment; elsewhere than Linux
the parent is checked between waits), or on error (the traceback's last lines
go to a shared buffer, which ``SamplerHandle.check`` puts in its error).
"""

from __future__ import annotations

import ctypes
import dataclasses
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from typing import Any

from absl import logging

from sao_jax.data import packing
from sao_jax.data.trajectory import StalenessPolicy
from sao_jax.sampler import devices
from sao_jax.sampler.stats import PHASES
from sao_jax.sampler.stats import SamplerStats


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
  staleness: StalenessPolicy
  cores: tuple[int, ...] = ()
  # The trainer's host in a multi-host run (its jax.process_index/count; the
  # sampler itself is not part of the distributed job): this sampler draws
  # only that host's shard of the prompts and fills its share of each batch.
  process_index: int = 0
  process_count: int = 1
  # The MAC keys of the ring and the weight slot (``ipc/mac.py``): they reach
  # the child through the spawn pipe, never shared memory or disk.
  ring_key: bytes | None = None
  weights_key: bytes | None = None
  # Episodes above ``start_episode`` the trainer consumed before a resume:
  # not started again (``consumed.ConsumedEpisodes.resume_plan``).
  skip_episodes: tuple[int, ...] = ()


def parse_cores(spec: str) -> tuple[int, ...]:
  """``config.sampler.devices`` as CPU core ids ('0,1' or '0-3'); '' = none."""
  spec = spec.strip()
  cores: list[int] = []
  for part in filter(None, spec.split(",")):
    lo, _, hi = part.partition("-")
    try:
      cores.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
      raise ValueError(
          f"config.sampler.devices={spec!r}: expected CPU core ids such as "
          "'0' or '0,2' or '0-3'.") from None
  return tuple(cores)


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_ERROR_BYTES = 2048  # Shared buffer for the tail of the sampler's traceback.


class SamplerDiedError(RuntimeError):
  """The sampler process exited without being asked to."""


def die_with_parent(parent_pid: int) -> None:
  """Makes the kernel SIGKILL this process when its parent exits (Linux).

  Unlike a check between waits, this also ends a sampler stuck in a hung
  environment call, so its attachments never pin the run's shared memory.
  Exits at once if the parent is already gone.
  """
  if sys.platform.startswith("linux"):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
      raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
  if os.getppid() != parent_pid:  # Died before prctl took effect.
    os._exit(0)  # pylint: disable=protected-access


class SamplerHandle:
  """Parent-side view of one sampler process and its shared control block."""

  def __init__(self, spec: SamplerSpec):
    ctx = mp.get_context("spawn")
    self.spec = spec
    self.trainer_step = ctx.Value("q", 0, lock=False)
    self.stop_event = ctx.Event()
    self.stats = ctx.Value(SamplerStats, lock=False)
    self.last_error = ctx.Array("c", _ERROR_BYTES, lock=False)
    self.process = ctx.Process(
        target=sampler_main, name=f"sao-sampler-{spec.lane}",
        args=(spec, self.trainer_step, self.stop_event, self.stats,
              self.last_error),
        # A daemonic process may not start children; the vLLM engine starts
        # its engine core as one (PR_SET_PDEATHSIG still ends the sampler
        # with the trainer, and `stop` ends it).
        daemon=str(spec.config.sampler.engine) != "vllm")

  def start(self) -> None:
    self.process.start()
    logging.info("Started sampler process pid %d (lane %d).",
                 self.process.pid, self.spec.lane)

  def set_trainer_step(self, step: int) -> None:
    self.trainer_step.value = int(step)

  def alive(self) -> bool:
    return self.process.is_alive()

  def check(self, wait_s: float = 0.0) -> None:
    """Raises ``SamplerDiedError`` if the sampler exited without being asked.

    Args:
      wait_s: Seconds to wait for it to exit first (when the ring already
        says its producer is gone but the process is still being reaped).
    """
    if wait_s > 0:
      self.process.join(wait_s)
    if self.process.is_alive() or self.stop_event.is_set():
      return
    code = self.process.exitcode
    how = (f"was killed by signal {-code}" if code is not None and code < 0
           else f"exited with code {code}")
    error = self.last_error.value.decode("utf-8", "replace").strip()
    raise SamplerDiedError(
        f"Sampler process {self.process.pid} {how}. "
        + (f"Its error:\n{error}" if error else
           "It left no error (killed from outside, e.g. by the OOM killer?); "
           "see its log lines above (prefixed 'sampler')."))

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


def _parent_alive(pid: int) -> bool:
  return os.getppid() == pid


def _record_error(buffer) -> None:
  """The last lines of the current exception's traceback, into ``buffer``."""
  text = traceback.format_exc().encode("utf-8", "replace")
  buffer.value = text[-(_ERROR_BYTES - 1):]


def sampler_main(spec: SamplerSpec, trainer_step, stop_event, stats,
                 last_error=None) -> None:
  """Entry point of the spawned sampler process."""
  die_with_parent(spec.parent_pid)
  # Heavy imports happen in _run, in the child, after affinity is set.
  from absl import logging as child_logging  # pylint: disable=g-import-not-at-top,reimported
  try:
    if spec.cores:
      os.sched_setaffinity(0, spec.cores)
    devices.apply(str(spec.config.sampler.chips), "sampler")
    child_logging.set_verbosity(child_logging.INFO)
    _run(spec, trainer_step, stop_event, stats)
    stats.alive = 2
  except _ParentGone:
    child_logging.warning("sampler: parent %d is gone; exiting.",
                          spec.parent_pid)
    stats.alive = 2
  except BaseException:
    stats.alive = -1
    if last_error is not None:
      _record_error(last_error)
    child_logging.exception("sampler: crashed.")
    raise


class _ParentGone(Exception):
  pass


def _attach_slot(name: str, mcfg, key: bytes | None):
  """The trainer's weight slot, read into the policy's params structure."""
  # pylint: disable=g-import-not-at-top
  import flax.linen as nn
  import jax
  import numpy as np
  from sao_jax.ipc import weights as weights_lib
  from sao_jax.models import transformer
  # pylint: enable=g-import-not-at-top
  tok = np.zeros((1, 1), np.int32)
  template = jax.eval_shape(
      lambda: transformer.Transformer(mcfg).init(
          jax.random.PRNGKey(0), tok, tok, tok == 0))["params"]
  return weights_lib.WeightSlot.attach(name, nn.unbox(template), key=key)


class _NewestWeights:
  """``() -> (params, version)``: the slot's newest weights, or the last ones.

  Versions only increase and never pass the trainer's step (the policy
  version is at most the step): anything else did not come from this run's
  trainer and is ignored with a warning.
  """

  def __init__(self, slot, stats: SamplerStats, trainer_step):
    self._slot, self._stats = slot, stats
    self._trainer_step = trainer_step
    self.params, self.version = None, None

  def _plausible(self, version: int) -> bool:
    newer = self.version is None or version > self.version
    if version == self.version:
      return False
    # The trainer publishes a step's weights just before it announces the
    # step: at most one ahead.
    if not newer or version > self._trainer_step.value + 1:
      logging.warning(
          "sampler: ignoring weights version %d (have %s, trainer at step "
          "%d): not published by this run's trainer.", version, self.version,
          self._trainer_step.value)
      return False
    return True

  def __call__(self):
    if self.version is not None and self._slot.latest_version() == self.version:
      return self.params, self.version  # Nothing newer: no copy, no MAC.
    t0 = time.perf_counter()
    try:
      got = self._slot.read(timeout=5.0)
    except TimeoutError as e:  # Keep the weights we have; retried later.
      logging.warning("sampler: %s Keeping weights version %s.", e,
                      self.version)
      got = None
    self._stats.rejected_weights = self._slot.rejected
    if got is not None and self._plausible(int(got[0])):
      self.version, self.params = got
      self._stats.weight_load_s += time.perf_counter() - t0
      self._stats.weights_version = self.version
    return self.params, self.version  # Nothing new: keep what we have.


def _run(spec: SamplerSpec, trainer_step, stop_event, stats) -> None:
  """The sampler loop (see module docstring)."""
  import jax  # pylint: disable=g-import-not-at-top

  from sao_jax.tokenization import text_tokenizer  # pylint: disable=g-import-not-at-top
  from sao_jax.data import prompts as prompts_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.envs import build as env_build  # pylint: disable=g-import-not-at-top
  from sao_jax.ipc import ring as ring_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.sampler import factory  # pylint: disable=g-import-not-at-top
  from sao_jax.sampler import feed as feed_lib  # pylint: disable=g-import-not-at-top
  from sao_jax.sampler import interface  # pylint: disable=g-import-not-at-top
  from sao_jax.sampler import rollout  # pylint: disable=g-import-not-at-top

  cfg = spec.config
  if cfg.sampler.compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir",
                      str(cfg.sampler.compilation_cache_dir))
    # Decode shapes compile in well under a second on CPU: cache them all.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  tokenizer = text_tokenizer.from_serialized(spec.tokenizer_proto)
  train_tasks, _ = env_build.build_tasks(cfg.env)
  settings = interface.RolloutSettings.from_config(cfg)
  options = settings.options
  prompt_ds = prompts_lib.prompt_dataset(
      range(len(train_tasks)), seed=int(cfg.train.seed),
      shard_index=spec.process_index, shard_count=spec.process_count)
  limits = settings.limits
  probe = env_build.make_envs(cfg.env, train_tasks, 1)[0]
  prompts = prompts_lib.FittingPrompts(
      prompt_ds, len(range(len(train_tasks))[spec.process_index::
                                               spec.process_count]),
      lambda task: len(rollout.prompt_tokens(probe, task, tokenizer, limits)),
      limits.max_total_tokens)
  slot = _attach_slot(spec.weights_name, spec.model_config, spec.weights_key)
  writer = ring_lib.RingWriter(spec.ring_name, spec.lane,
                               timeout=float(cfg.ring.put_timeout_s),
                               key=spec.ring_key)
  base_key = jax.random.PRNGKey(int(cfg.train.seed) + 1)
  if spec.process_count > 1:  # Each host its own sampling noise.
    base_key = jax.random.fold_in(base_key, spec.process_index)

  def task_of(draw: int) -> int:
    """Prompt selection: over-long prompts are skipped here, and counted."""
    task = int(prompts[draw])
    stats.skipped_long_prompts = prompts.skipped
    env_build.publish_metrics(stats)
    return task

  def should_stop() -> bool:
    if not _parent_alive(spec.parent_pid):
      raise _ParentGone()
    return stop_event.is_set()

  feed = feed_lib.EpisodeFeed(
      task_of=task_of, outbox=feed_lib.Outbox(writer, stats, should_stop),
      stats=stats, staleness=spec.staleness,
      train_batch=(packing.trajectories_per_step_bound(cfg)
                   // spec.process_count),
      trainer_step=lambda: trainer_step.value, n_rollouts=options.n_rollouts,
      process_index=spec.process_index, process_count=spec.process_count,
      start=int(spec.start_episode), skip=spec.skip_episodes)
  engine = factory.make_rollout(
      cfg, model_config=spec.model_config, tokenizer=tokenizer,
      envs=env_build.make_envs(cfg.env, train_tasks, options.num_slots),
      weights=_NewestWeights(slot, stats, trainer_step), stats=stats,
      rng=base_key, settings=settings)
  stats.alive = 1
  stats.enter(PHASES[1])
  logging.info("sampler: %s engine starting at episode %d (skipping %d "
               "consumed above it), %d slots (refill %s), admission bound %d, "
               "prompt shard %d of %d.", engine.name, spec.start_episode,
               len(spec.skip_episodes), options.num_slots, options.refill,
               spec.staleness.admission_bound, spec.process_index,
               spec.process_count)
  try:
    engine.start()
    engine.run(feed, should_stop)
  finally:
    engine.stop()
    writer.close()
    slot.close()
    logging.info("sampler: stopped after %d episodes (%d in flight "
                 "abandoned).", int(stats.episodes),
                 int(stats.episodes_aborted))
