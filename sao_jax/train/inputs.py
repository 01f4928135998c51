"""Where the loop's batches come from: a live sampler, or a recorded stream.

``live`` (docs/design/overview.md "The shape") starts what an asynchronous run
trains on: the trajectory ring, the weight slot with its ``Publisher``, the
sampler process and the trainer's ``TrajectoryStream`` over the ring (recorded
to ``workdir/stream`` with ``train.record_stream``); ``replay`` reads a recorded
stream instead (docs/design/data_path.md "Record and replay",
``train.mode='replay'``). Both yield a ``Source``: global ``[B, T]`` batches on
the mesh, ready for the step, and what the loop reports about them. ``live``
stops the sampler and unlinks the shared memory on every way out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Iterator

from absl import logging
import jax

from sao_jax import sharding
from sao_jax.data import consumed as consumed_lib
from sao_jax.data import packing
from sao_jax.data import record as record_lib
from sao_jax.data import stream as stream_lib
from sao_jax.data import trajectory as traj_lib
from sao_jax.ipc import ring as ring_lib
from sao_jax.ipc import weights as weights_lib
from sao_jax.sampler import precision
from sao_jax.sampler import process as sampler_lib
from sao_jax.sampler import rollout
from sao_jax.sampler import supervisor as supervisor_lib
from sao_jax.train import publish as publish_lib
from sao_jax.train import setup as setup_lib


@dataclasses.dataclass
class Source:
  """The loop's input. A replay has no sampler, ring or publisher (None).

  Attributes:
    config: The run's config.
    stream: Yields the batches (``dataset``) and counts what it read.
    stop_step: The loop stops before this step (a replay: where the recording
      or ``train.replay_steps`` ends).
    sampler, ring, publish: The live run's sampler process, trajectory ring
      and weight publisher.
    recorder: ``train.record_stream``'s recorder.
    unread_at_stop: Records the sampler had written that were still in the
      ring when it stopped (never read; a resumed run generates them again);
      None until ``stop_sampler``.
  """

  config: Any
  stream: Any  # stream_lib.TrajectoryStream | record_lib.ReplayStream
  stop_step: int
  sampler: supervisor_lib.SupervisedSampler | None = None
  ring: Any = None  # The sampler's ring reader (SupervisedSampler.reader).
  publish: publish_lib.Publisher | None = None
  recorder: record_lib.StreamRecorder | None = None
  unread_at_stop: int | None = None

  def batches(self, start_step: int) -> Iterator[dict[str, jax.Array]]:
    """The global batches of steps ``start_step, ...``; where there is none,
    an error that says why."""
    it = iter(self.stream.dataset)
    t = self.config.train
    for step in range(start_step, self.stop_step):
      try:
        batch = next(it, None)
      except ring_lib.RingEmptyError:
        raise TimeoutError(
            f"Step {step + 1}: no trajectory for the batch of "
            f"{int(t.batch_size)} within "
            f"{rollout.data_wait_s(self.config)[1]} "
            f"({self.stream.counters.records_read} read so far); "
            f"{self.sampler.stats.describe()}. A hung environment call ends "
            "its episode at env.step_timeout_s; raise ring.get_timeout_s for "
            "slow generation.") from None
      if batch is None and self.sampler is None:
        raise ValueError(f"Step {step + 1}: the recorded stream ends here.")
      if batch is None:  # The ring says its producer is gone.
        self.sampler.check(wait_s=10.0)
        raise sampler_lib.SamplerDiedError(
            f"Step {step + 1}: the trajectory stream ended (the ring's "
            "producer closed) but the sampler process is still running.")
      yield batch

  def step_done(self, done: int, params: Any, version: int,
                publish: bool) -> None:
    """Publishes the policy (if due) and tells the sampler the new step."""
    if self.publish is not None and publish:
      self.publish(params, version)
    if self.sampler is not None:
      self.sampler.set_trainer_step(done)

  def stop_sampler(self) -> None:
    """Stops the sampler, then counts the records left unread in the ring
    (``unread_at_stop``); once."""
    if self.sampler is None or self.unread_at_stop is not None:
      return
    self.sampler.stop()
    self.unread_at_stop = 0
    while True:
      try:
        self.ring.read(timeout=0.0)
      except (ring_lib.RingEmptyError, ring_lib.RingDrained):
        break
      except ring_lib.RingError as e:  # Counting must not mask the exit.
        logging.warning("Counting the unread records stopped at %d: %s",
                        self.unread_at_stop, e)
        break
      self.unread_at_stop += 1
    if self.unread_at_stop:
      logging.info("%d trajectories were left unread in the ring at the "
                   "stop; a resumed run generates them again.",
                   self.unread_at_stop)

  def close_recorder(self) -> None:
    """Closes the recording (before the final checkpoint covers its steps)."""
    if self.recorder is not None:
      self.recorder.close()


def _recorder(config: Any, workdir: str,
              start_step: int) -> record_lib.StreamRecorder | None:
  """The stream recorder of ``train.record_stream`` (None when off)."""
  if not config.train.record_stream:
    return None
  return record_lib.StreamRecorder(
      os.path.join(workdir, "stream"), start_step=start_step,
      shard_steps=int(config.train.record_shard_steps),
      checkpoint_every=int(config.train.checkpoint_every),
      process_index=jax.process_index(), config=config)


@contextlib.contextmanager
def live(run: setup_lib.Setup, workdir: str, *, params: Any, start_step: int,
         version: Any, consumed: consumed_lib.ConsumedEpisodes,
         stop_step: int) -> Iterator[Source]:
  """Ring, weight slot, sampler and stream (see the module docstring).

  ``params`` are the policy's first published weights, ``version()`` the
  trainer's policy version (read as each record is consumed) and
  ``consumed`` this host's consumed episodes: the sampler resumes at its
  watermark, skipping those above it, and the stream adds what it reads. A
  sampler that dies is started again there (``supervisor.SupervisedSampler``,
  ``sampler.max_restarts``), on a new ring the stream reads through
  ``Source.ring``.
  """
  config = run.config
  staleness = traj_lib.StalenessPolicy.from_config(config)
  start_episode, skip = consumed.resume_plan()
  # Both authenticated: only the sampler, given the keys, writes to them.
  make_ring = functools.partial(
      ring_lib.RingReader.create, num_lanes=1,
      lane_bytes=int(config.ring.capacity_bytes) // 64 * 64,
      authenticate=True)
  ring = make_ring()
  # The sampler's copy of the policy, in sampler.param_dtype (precision.py);
  # the slot is laid out from shapes alone (the first publish copies).
  sampler_mcfg = precision.sampler_model_config(config, run.mcfg)
  to_sampler = precision.caster(sampler_mcfg.param_dtype)
  slot = weights_lib.WeightSlot.create(
      jax.eval_shape(functools.partial(
          precision.cast_params, dtype=sampler_mcfg.param_dtype), params),
      authenticate=True)
  source = Source(config, stream=None, stop_step=stop_step,
                  recorder=_recorder(config, workdir, start_step))
  try:
    # Held-back versions (the staleness study's lag) wait on disk.
    source.publish = publish_lib.Publisher(
        slot, staleness.publish_lag,
        spill_dir=os.path.join(workdir,
                               f"held_weights_p{jax.process_index()}"),
        cast=to_sampler)
    source.publish(params, version())
    spec = sampler_lib.SamplerSpec(
        config=config, model_config=sampler_mcfg,
        tokenizer_proto=run.tokenizer.serialized_proto(),
        ring_name=ring.name, lane=0, weights_name=slot.name,
        parent_pid=os.getpid(),
        start_episode=start_episode, skip_episodes=tuple(sorted(skip)),
        staleness=staleness,
        cores=sampler_lib.parse_cores(str(config.sampler.devices)),
        process_index=jax.process_index(),
        process_count=jax.process_count(), ring_key=ring.key,
        weights_key=slot.key)
    # Restarted when it dies, at the consumed watermark (supervisor.py).
    source.sampler = supervisor_lib.SupervisedSampler(
        spec, ring, make_ring, consumed,
        supervisor_lib.RestartPolicy.from_config(config))
    source.ring = source.sampler.reader  # The current sampler's ring.
    source.sampler.set_trainer_step(start_step)
    source.sampler.start()
    source.stream = stream_lib.TrajectoryStream(
        source.ring, batch_size=setup_lib.local_batch_size(config),
        seq_len=int(config.train.max_seq_len), trainer_version=version,
        staleness=staleness, overlong="truncate", pad_id=run.tokenizer.pad_id,
        read_timeout=rollout.data_wait_s(config)[0],
        check_producers=source.sampler.check,
        process_index=jax.process_index(),
        max_error_frac=float(config.train.max_error_frac),
        recorder=source.recorder, trusted_versions=True, consumed=consumed,
        batch_sharding=sharding.batch_sharding(run.mesh, run.rules),
        pack_segments=packing.pack_segments(config))
    source.stream.counters.load(run.meta.get("stream", {}))
    yield source
  finally:
    source.close_recorder()
    source.stop_sampler()
    (source.ring or ring).close()
    slot.close()
    if source.publish is not None:
      source.publish.close()


def replay(run: setup_lib.Setup, *, start_step: int,
           stop_step: int) -> Source:
  """The recorded stream of ``train.replay_from``, from ``start_step``."""
  config = run.config
  directory = os.path.join(str(config.train.replay_from), "stream")
  changed = record_lib.config_differences(directory, config)
  logging.info("Replaying %s; config keys that differ from the recorded "
               "run's: %s", directory, ", ".join(changed) or "none")
  _, recorded_end = record_lib.recorded_range(directory, jax.process_index())
  window = tuple(config.train.replay_steps)
  stop_step = min(stop_step, int(window[1]) if window else recorded_end)
  stream = record_lib.ReplayStream(
      directory, start=start_step, stop=stop_step,
      batch_size=setup_lib.local_batch_size(config),
      seq_len=int(config.train.max_seq_len), overlong="truncate",
      pad_id=run.tokenizer.pad_id, process_index=jax.process_index(),
      batch_sharding=sharding.batch_sharding(run.mesh, run.rules))
  stream.counters.load(run.meta.get("stream", {}))
  return Source(config, stream=stream, stop_step=stop_step)
