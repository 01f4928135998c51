"""``train_and_evaluate(config, workdir)``: the asynchronous SAO loop end to end.

One trainer process (this one) and one sampler host process (spawned)
(docs/DESIGN.md §1)::

  sampler ──trajectories──► ring ──grain stream──► jitted SAO step
     ▲                                                  │
     └──────────── versioned weight slot ◄──────────────┘

``setup.build`` makes the tokenizer, the policy (HF checkpoint, or random init
+ SFT warm start), critic, optimizers and train state, restored from the newest
checkpoint in ``workdir/checkpoints`` if there is one; the sampler is told
where to resume (``episodes_consumed``) so prompts continue exactly.

Modes: ``async`` (the sampler runs ahead up to ``max_staleness`` steps),
``sync`` (bound 0: strict generate→train alternation) and ``group`` (sync, with
``n_rollouts`` per prompt); one ``StalenessPolicy`` bounds sampler and stream.
``train.record_stream`` records the stream to ``workdir/stream``; ``replay``
runs the trainer alone on a recorded stream (``sao_jax.data.record``).

Every ``log_every`` steps scalars go to TensorBoard (``workdir/tb``); held-out
accuracy every ``eval_every`` policy steps; orbax checkpoints every
``checkpoint_every`` steps and at the end. The sampler is stopped and the
shared-memory segments unlinked on every exit path, SIGTERM included.

Faults (issue 17): a non-finite update is skipped in the jitted step and
``train.max_skipped_steps`` in a row stop the run (``health.SkipGuard``); an
error or SIGTERM first checkpoints the last completed step (one process);
a dead sampler, a wait for data past ``ring.get_timeout_s`` and too many
ERROR trajectories each end the run with one error saying what happened.
"""

from __future__ import annotations

import os
import time
from typing import Any

import jax
from absl import logging

from sao_jax import sharding
from sao_jax.data import trajectory as traj_lib
from sao_jax.data import record as record_lib
from sao_jax.data import stream as stream_lib
from sao_jax.ipc import ring as ring_lib
from sao_jax.ipc import segment
from sao_jax.ipc import weights as weights_lib
from sao_jax.sampler import process as sampler_lib
from sao_jax.train import evaluate as eval_lib
from sao_jax.train import health
from sao_jax.train import metrics as metrics_lib
from sao_jax.train import publish as publish_lib
from sao_jax.train import setup as setup_lib


class _Trainer:
  """The loop's state: the train state, its version, progress and rates."""

  def __init__(self, run: setup_lib.Setup, writer: metrics_lib.MetricWriter):
    self.run, self.writer = run, writer
    self.state = run.state
    self.clock = metrics_lib.RunClock()
    self.consumed = int(run.meta["episodes_consumed"])
    self.warmup = int(run.config.rl.critic_warmup_steps)
    self.total_steps = self.warmup + int(run.config.train.num_steps)
    self._last_log = (time.perf_counter(), 0.0)  # (time, sampler tokens)
    self._version = int(self.state.policy_version)
    self.start_step = int(self.state.step)
    self.meta_step = self.start_step  # The step run.meta describes.
    self.skips = health.SkipGuard(int(run.config.train.max_skipped_steps))

  def policy_version(self) -> int:
    """The version staleness is measured against (docs/DESIGN.md §4)."""
    return self._version

  def step(self, step: int, host_batch: dict[str, Any]
           ) -> tuple[dict[str, Any], bool]:
    """One jitted step on the global batch: (its metrics, whether skipped)."""
    run = self.run
    batch = sharding.make_global_batch(host_batch, run.mesh, run.rules)
    train_step = run.full_step if step >= self.warmup else run.critic_only_step
    with sharding.mesh_rules(run.mesh, run.rules):
      self.state, metrics = train_step(self.state, batch)
    # One host sync per step, as before: the version and the skip flag.
    version, skipped = jax.device_get(
        (self.state.policy_version, metrics["health/skipped"]))
    self._version = int(version)
    return metrics, bool(skipped)

  def evaluate(self, step: int, generated: float) -> dict[str, float]:
    run = self.run
    result = eval_lib.evaluate(
        sharding.to_host(self.state.policy_params), run.mcfg, run.config,
        run.tokenizer, run.eval_tasks, version=self.policy_version())
    self.writer.write_scalars(step, {**result,
                                     "tokens/generated_total": generated})
    return result

  def log(self, done: int, metrics: Any, host_batch: dict[str, Any],
          stream: stream_lib.TrajectoryStream, sampler_stats,
          ring: ring_lib.RingReader | None, publish_s: float | None) -> None:
    """Writes the step's scalars and staleness histogram; one log line.

    A replay passes None for ``sampler_stats``, ``ring`` and ``publish_s``.
    """
    now = time.perf_counter()
    since = max(now - self._last_log[0], 1e-9)
    metrics = jax.device_get(metrics)
    live = sampler_stats is not None
    sampled = sampler_stats.action_tokens if live else 0.0
    scalars = metrics_lib.step_scalars(
        metrics, host_batch, policy_version=self.policy_version(),
        trainer_tokens_per_s=float(metrics["tokens/action"]) * int(
            self.run.config.train.log_every) / since,
        sampler_tokens_per_s=(sampled - self._last_log[1]) / since,
        trainer_idle_frac=self.clock.trainer_wait / self.clock.elapsed,
        sampler_stats=sampler_stats.as_dict() if live else None,
        sampler_idle_frac=sampler_stats.idle_frac() if live else None,
        publish_s=publish_s, generated_tokens=self.generated(stream),
        stream_counters=stream.counters.as_dict(),
        ring_stats=ring.stats() if ring is not None else None)
    scalars["health/skipped_steps"] = float(self.skips.skipped_total)
    self._last_log = (now, sampled)
    self.writer.write_scalars(done, scalars)
    self.writer.write_histograms(done, {"staleness": host_batch["staleness"]})
    self.writer.flush()
    logging.info(
        "step %d/%d | v%d | reward %.3f | accept %.3f | value_loss %.4f | "
        "staleness %.2f | %.1fs elapsed", done, self.total_steps,
        self.policy_version(), scalars["reward/mean"],
        scalars.get("policy/accept_frac", float("nan")),
        scalars.get("critic/value_loss", float("nan")),
        scalars["staleness/mean"], self.clock.elapsed)

  @staticmethod
  def generated(stream: stream_lib.TrajectoryStream) -> int:
    """Action tokens the trainers of all hosts have read from their rings."""
    return stream.counters.action_tokens_read * jax.process_count()


def _train(trainer: _Trainer, ring: ring_lib.RingReader | None,
           publish: publish_lib.Publisher | None,
           sampler: sampler_lib.SamplerHandle | None,
           stream: stream_lib.TrajectoryStream) -> None:
  """Steps until ``total_steps`` or the generated-token budget.

  A replay has no ring, publisher or sampler (None): ``stream`` is then a
  ``record.ReplayStream``.
  """
  run, config, clock = trainer.run, trainer.run.config, trainer.clock
  token_budget = int(config.train.max_generated_tokens)
  t = config.train
  every = {"publish": int(t.publish_every), "log": int(t.log_every),
           "eval": int(t.eval_every), "checkpoint": int(t.checkpoint_every)}
  start_step = int(trainer.state.step)
  batches = iter(stream.dataset)
  for step in range(start_step, trainer.total_steps):
    t_wait, read_before = time.perf_counter(), stream.counters.records_read
    try:
      host_batch = next(batches, None)
    except ring_lib.RingEmptyError:
      raise TimeoutError(
          f"Step {step + 1}: no batch of {int(t.batch_size)} trajectories "
          f"within ring.get_timeout_s={float(config.ring.get_timeout_s):g} s "
          f"({stream.counters.records_read} read so far); "
          f"{sampler.stats.describe()}. A slow environment is bounded by "
          "env.step_timeout_s; raise ring.get_timeout_s for slow "
          "generation.") from None
    if host_batch is None and sampler is None:
      raise ValueError(f"Step {step + 1}: the recorded stream ends here.")
    if host_batch is None:  # The ring says its producer is gone.
      sampler.check(wait_s=10.0)
      raise sampler_lib.SamplerDiedError(
          f"Step {step + 1}: the trajectory stream ended (the ring's producer "
          "closed) but the sampler process is still running.")
    clock.trainer_wait += time.perf_counter() - t_wait
    trainer.consumed += (stream.counters.records_read - read_before
                         ) * jax.process_count()
    metrics, skipped = trainer.step(step, host_batch)
    done = step + 1
    run.meta.update(episodes_consumed=trainer.consumed,
                    stream=stream.counters.as_dict())
    trainer.meta_step = done
    trainer.skips.observe(done, skipped, metrics)
    last = done == trainer.total_steps
    if publish is not None and (done % every["publish"] == 0 or last):
      publish(trainer.state.policy_params, trainer.policy_version())
    generated = trainer.generated(stream)
    out_of_tokens = bool(token_budget) and generated >= token_budget
    if sampler is not None:
      sampler.set_trainer_step(done)
    clock.step_done(done, start_step)
    if done % every["log"] == 0 or last or out_of_tokens:
      trainer.log(done, metrics, host_batch, stream,
                  sampler.stats if sampler is not None else None, ring,
                  publish.seconds if publish is not None else None)
    policy_steps = done - trainer.warmup
    more = not (last or out_of_tokens)
    if (every["eval"] and policy_steps > 0 and more
        and policy_steps % every["eval"] == 0):
      accuracy = trainer.evaluate(done, generated)["eval/accuracy"]
      logging.info("step %d: held-out accuracy %.3f", done, accuracy)
    if every["checkpoint"] and done % every["checkpoint"] == 0 and more:
      run.ckpt.save(done, trainer.state, run.meta)
    if out_of_tokens:
      logging.info("Generated-token budget reached: %d >= %d tokens at "
                   "step %d.", generated, token_budget, done)
      break


def _save_on_exit(trainer: _Trainer) -> None:
  """Checkpoints the last completed step of a run stopped by SIGTERM or an
  error, so that at most the step in flight is lost (never a NaN state:
  ``Checkpointer.save`` refuses those)."""
  run = trainer.run
  if jax.process_count() > 1:  # A save is collective: peers may be gone.
    logging.warning("Multi-host run stopped: no checkpoint on the way out; "
                    "the newest is step %s.", run.ckpt.latest_step())
    return
  try:
    step = int(trainer.state.step)
    if step != trainer.meta_step:
      logging.warning("Stopped inside step %d: no checkpoint on the way out.",
                      step)
    elif step > trainer.start_step and step != run.ckpt.latest_step():
      logging.warning("Run stopped: saving step %d before exiting.", step)
      run.ckpt.save(step, trainer.state, run.meta)
  except Exception:  # pylint: disable=broad-except
    logging.exception("Could not save a checkpoint on the way out.")




def _finish(trainer: _Trainer, stream, start_step: int,
            sampler_stats) -> dict[str, float]:
  """The final checkpoint and eval; returns the run's summary."""
  run = trainer.run
  final_step = int(trainer.state.step)
  if final_step > start_step or run.ckpt.latest_step() != final_step:
    run.ckpt.save(final_step, trainer.state, run.meta)
  final_eval = trainer.evaluate(final_step, float(trainer.generated(stream)))
  return metrics_lib.run_summary(
      run.meta["eval_before"], final_eval, final_step,
      trainer.policy_version(), stream.counters.as_dict(),
      jax.process_count(), sampler_stats, trainer.clock)


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


def _run_replay(trainer: _Trainer) -> dict[str, float]:
  """The trainer alone on the recorded stream of ``train.replay_from``."""
  run, config = trainer.run, trainer.run.config
  directory = os.path.join(str(config.train.replay_from), "stream")
  changed = record_lib.config_differences(directory, config)
  logging.info("Replaying %s; config keys that differ from the recorded "
               "run's: %s", directory, ", ".join(changed) or "none")
  start_step = int(trainer.state.step)
  _, recorded_end = record_lib.recorded_range(directory, jax.process_index())
  window = tuple(config.train.replay_steps)
  trainer.total_steps = min(trainer.total_steps,
                            int(window[1]) if window else recorded_end)
  stream = record_lib.ReplayStream(
      directory, start=start_step, stop=trainer.total_steps,
      batch_size=setup_lib.local_batch_size(config),
      seq_len=int(config.train.max_seq_len), overlong="truncate",
      pad_id=run.tokenizer.pad_id, process_index=jax.process_index())
  stream.counters.load(run.meta.get("stream", {}))
  _train(trainer, None, None, None, stream)
  return _finish(trainer, stream, start_step, None)


def _run_async(trainer: _Trainer, workdir: str) -> dict[str, float]:
  """Ring, weight slot and sampler around ``_train``; then the final eval."""
  run, config = trainer.run, trainer.run.config
  staleness = traj_lib.StalenessPolicy.from_config(config)
  ring = ring_lib.RingReader.create(
      num_lanes=1, lane_bytes=int(config.ring.capacity_bytes) // 64 * 64)
  slot = weights_lib.WeightSlot.create(
      sharding.to_host(trainer.state.policy_params))
  sampler = None
  recorder = _recorder(config, workdir, int(trainer.state.step))
  try:
    publish = publish_lib.Publisher(slot, staleness.publish_lag)
    publish(trainer.state.policy_params, trainer.policy_version())
    sampler = sampler_lib.SamplerHandle(sampler_lib.SamplerSpec(
        config=config, model_config=run.mcfg,
        tokenizer_proto=run.tokenizer.serialized_proto(),
        ring_name=ring.name, lane=0, weights_name=slot.name,
        parent_pid=os.getpid(),
        start_episode=trainer.consumed // jax.process_count(),
        staleness=staleness,
        cores=sampler_lib.parse_cores(str(config.sampler.devices)),
        process_index=jax.process_index(),
        process_count=jax.process_count()))
    sampler.set_trainer_step(int(trainer.state.step))
    sampler.start()
    stream = stream_lib.TrajectoryStream(
        ring, batch_size=setup_lib.local_batch_size(config),
        seq_len=int(config.train.max_seq_len),
        trainer_version=trainer.policy_version, staleness=staleness,
        overlong="truncate", pad_id=run.tokenizer.pad_id,
        read_timeout=float(config.ring.get_timeout_s),
        check_producers=sampler.check, process_index=jax.process_index(),
        max_error_frac=float(config.train.max_error_frac),
        recorder=recorder)
    stream.counters.load(run.meta.get("stream", {}))
    start_step = int(trainer.state.step)
    try:
      _train(trainer, ring, publish, sampler, stream)
    except BaseException:  # SIGTERM arrives as KeyboardInterrupt.
      _save_on_exit(trainer)
      raise
    if recorder is not None:
      recorder.close()  # Before the final checkpoint covers its steps.
    return _finish(trainer, stream, start_step, sampler.stats)
  finally:
    if recorder is not None:
      recorder.close()
    if sampler is not None:
      sampler.stop()
    ring.close()
    slot.close()


def train_and_evaluate(config: Any, workdir: str) -> dict[str, float]:
  """Runs SFT (if configured), asynchronous SAO RL and evaluation.

  Returns:
    A summary: held-out accuracy before/after RL, steps, trajectories, tokens/s,
    mean staleness, ring and sampler counters.
  """
  os.makedirs(workdir, exist_ok=True)
  workdir = os.path.abspath(workdir)
  setup_lib.local_batch_size(config)  # Fail before any compute.
  # One event file and one summary.json per run: process 0 writes them (the
  # losses are global; ring, sampler and staleness figures are its host's).
  primary = jax.process_index() == 0
  writer = metrics_lib.MetricWriter(os.path.join(workdir, "tb"),
                                    active=primary)
  run = None
  try:
    run = setup_lib.build(config, workdir, writer, primary)
    trainer = _Trainer(run, writer)
    if run.meta.get("eval_before") is None:
      run.meta["eval_before"] = trainer.evaluate(int(run.state.step), 0.0)
      logging.info("Held-out accuracy before RL: %.3f",
                   run.meta["eval_before"]["eval/accuracy"])
    with segment.sigterm_unwinds():
      summary = (_run_replay(trainer) if config.train.mode == "replay"
                 else _run_async(trainer, workdir))
    writer.write_scalars(int(trainer.state.step),
                         {f"summary/{k}": v for k, v in summary.items()})
    logging.info("Summary: %s", summary)
    if primary:
      metrics_lib.write_json_atomic(os.path.join(workdir, "summary.json"),
                                  summary)
    return summary
  finally:
    writer.close()
    if run is not None:
      run.ckpt.close()
