"""``train_and_evaluate(config, workdir)``: the asynchronous SAO loop end to end.

One trainer process (this one) and one sampler host process
(docs/design/data_path.md "File by file")::

  sampler ──trajectories──► ring ──grain stream──► jitted SAO step
     ▲                                                  │
     └──────────── versioned weight slot ◄──────────────┘

``setup.build`` makes (or restores) tokenizer, policy, critic, optimizers and
train state; ``inputs`` supplies the batches, global on the mesh (a live
sampler behind the ring, or a recorded stream in ``replay`` mode); ``finish``
saves and evaluates the last step, or saves the last completed one when the
run is stopped. The loop steps until ``num_steps``, the generated-token budget
or the time budget, and logs, evaluates and checkpoints on its schedule.
Faults (docs/design/failures.md): non-finite steps are skipped
(``health.SkipGuard``); SIGTERM and errors save the last completed step; a
dead sampler, a wait past ``rollout.data_wait_s`` and too many ERROR
trajectories each end the run with one error saying what happened.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

import jax
from absl import logging

from sao_jax import sharding
from sao_jax.data import consumed as consumed_lib
from sao_jax.ipc import segment
from sao_jax.train import evaluate as eval_lib
from sao_jax.train import finish as finish_lib
from sao_jax.train import health
from sao_jax.train import inputs as inputs_lib
from sao_jax.train import metrics as metrics_lib
from sao_jax.train import setup as setup_lib
from sao_jax.train import workdir_lock


class _Trainer:
  """The loop's state: the train state, its version, progress and rates."""

  def __init__(self, run: setup_lib.Setup, writer: metrics_lib.MetricWriter,
               scores_dir: str | None = None):
    self.run, self.writer = run, writer
    self.scores_dir = scores_dir  # Per-problem eval scores (None: not kept).
    self.state = run.state
    self.clock = metrics_lib.RunClock()
    self.consumed = int(run.meta["episodes_consumed"])
    self.episodes = consumed_lib.from_meta(  # Where the sampler resumes.
        run.meta, int(run.config.sampler.n_rollouts))
    self.warmup = int(run.config.rl.critic_warmup_steps)
    self.total_steps = self.warmup + int(run.config.train.num_steps)
    self._last_log = (time.perf_counter(), 0.0)  # (time, sampler tokens)
    self._version = int(self.state.policy_version)
    self.start_step = int(self.state.step)
    self.meta_step = self.start_step  # The step of the state run.meta is for.
    self.skips = health.SkipGuard(int(run.config.train.max_skipped_steps))

  def policy_version(self) -> int:
    """The version staleness is measured against (docs/design/data_path.md
    "Staleness")."""
    return self._version

  def step(self, step: int, batch: dict[str, jax.Array],
           consumption: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """One jitted step on the global batch: (its metrics, whether skipped).

    ``consumption`` (what the batch consumed) enters ``run.meta`` with the
    step's new state, so a checkpoint never counts a batch it did not train.
    """
    run = self.run
    train_step = run.full_step if step >= self.warmup else run.critic_only_step
    # The step donates the old state: a SIGTERM between the call and the
    # assignment would leave neither to save, so it waits for the block. The
    # new state goes with run.meta from here on, before the wait for its
    # result, so a SIGTERM during that wait still saves it (finish.py).
    with sharding.mesh_rules(run.mesh, run.rules), segment.sigterm_deferred():
      self.state, metrics = train_step(self.state, batch)
      run.meta.update(consumption)
      self.meta_step = step + 1
    # One host sync per step, as before: the version and the skip flag.
    version, skipped = jax.device_get(
        (self.state.policy_version, metrics["health/skipped"]))
    self._version = int(version)
    return metrics, bool(skipped)

  def evaluate(self, step: int, generated: float | None) -> dict[str, float]:
    """Held-out evaluation of the current policy at ``step`` (``generated``:
    the action tokens read so far, None when unknown: not written)."""
    run = self.run
    result = eval_lib.evaluate(
        sharding.to_host(self.state.policy_params), run.mcfg, run.config,
        run.tokenizer, run.eval_tasks, version=self.policy_version(),
        batch_size=int(run.config.train.eval_batch_size), step=step,
        scores_dir=self.scores_dir)
    self.writer.write_scalars(step, result if generated is None else {
        **result, "tokens/generated_total": generated})
    # In the meta the step's checkpoint saves: a resume knows it was done.
    run.meta["evaluated_step"] = step
    return result

  def eval_due(self, step: int) -> bool:
    """Whether ``train.eval_every`` schedules an evaluation after ``step``
    (not after the last: the final evaluation is the summary's)."""
    every = int(self.run.config.train.eval_every)
    policy_steps = step - self.warmup
    return bool(every and policy_steps > 0 and policy_steps % every == 0
                and step < self.total_steps)

  def catch_up_eval(self) -> None:
    """The evaluation scheduled after the resumed step, when a stop cut it
    short (the checkpoint saved on the way out records no evaluation at its
    step): a resumed run keeps every evaluation. The meta is the same on
    every host, so all of them evaluate or none."""
    step = int(self.state.step)
    done = self.run.meta.get("evaluated_step")
    if done is not None and done < step and self.eval_due(step):
      logging.info("Step %d's evaluation did not finish before the stop: "
                   "running it now.", step)
      self.evaluate(step, None)

  def log(self, done: int, metrics: Any, batch: dict[str, jax.Array],
          source: inputs_lib.Source) -> None:
    """Writes the step's scalars and staleness histogram; one log line."""
    now = time.perf_counter()
    since = max(now - self._last_log[0], 1e-9)
    metrics = jax.device_get(metrics)
    staleness = metrics_lib.trajectory_values(batch, "staleness",
                                              sharding.process_rows)
    stats = source.sampler.stats if source.sampler is not None else None
    sampled = stats.action_tokens if stats is not None else 0.0
    scalars = metrics_lib.step_scalars(
        metrics, staleness, policy_version=self.policy_version(),
        skipped_steps=self.skips.skipped_total,
        span=metrics_lib.batch_version_span(batch, sharding.process_rows),
        trainer_tokens_per_s=float(metrics["tokens/action"]) * int(
            self.run.config.train.log_every) / since,
        sampler_tokens_per_s=(sampled - self._last_log[1]) / since,
        trainer_idle_frac=self.clock.trainer_wait / self.clock.elapsed,
        sampler_stats=stats.as_dict() if stats is not None else None,
        sampler_idle_frac=stats.idle_frac() if stats is not None else None,
        publish_s=(source.publish.seconds if source.publish is not None
                   else None),
        generated_tokens=self.generated(source.stream),
        stream_counters=source.stream.counters.as_dict(),
        ring_stats=source.ring.stats() if source.ring is not None else None)
    self._last_log = (now, sampled)
    self.writer.write_scalars(done, scalars)
    self.writer.write_histograms(done, {"staleness": staleness})
    self.writer.flush()
    logging.info(
        "step %d/%d | v%d | reward %.3f | accept %.3f | value_loss %.4f | "
        "staleness %.2f | %.1fs elapsed", done, self.total_steps,
        self.policy_version(), scalars["reward/mean"],
        scalars.get("policy/accept_frac", float("nan")),
        scalars.get("critic/value_loss", float("nan")),
        scalars["staleness/mean"], self.clock.elapsed)

  @staticmethod
  def generated(stream: Any) -> int:
    """Action tokens all hosts' trainers have read from their rings."""
    return stream.counters.action_tokens_read * jax.process_count()


def _train(trainer: _Trainer, source: inputs_lib.Source) -> None:
  """Steps until ``source.stop_step``, the generated-token or the time budget."""
  run, clock = trainer.run, trainer.clock
  t = run.config.train
  counters = source.stream.counters
  start_step = int(trainer.state.step)
  batches = source.batches(start_step)
  for step in range(start_step, source.stop_step):
    t_wait, read_before = time.perf_counter(), counters.records_read
    batch = next(batches)
    clock.trainer_wait += time.perf_counter() - t_wait
    trainer.consumed += (counters.records_read - read_before
                         ) * jax.process_count()
    # Recorded with the step's state (docs/design/sampler.md "Exactly once
    # across stop and resume").
    metrics, skipped = trainer.step(step, batch, dict(
        episodes_consumed=trainer.consumed, stream=counters.as_dict(),
        **consumed_lib.meta(trainer.episodes, collective=False)))
    done = step + 1
    trainer.skips.observe(done, skipped, metrics)
    last = done == source.stop_step
    source.step_done(done, trainer.state.policy_params,
                     trainer.policy_version(),
                     publish=done % int(t.publish_every) == 0 or last)
    generated = trainer.generated(source.stream)
    stop = health.budget_spent(run.config, generated, clock.elapsed)
    # The first policy update compiles a second step: count from after it.
    clock.step_done(done, max(start_step, trainer.warmup))
    if done % int(t.log_every) == 0 or last or stop:
      trainer.log(done, metrics, batch, source)
    more = not (last or stop)
    if more and trainer.eval_due(done):
      accuracy = trainer.evaluate(done, generated)["eval/accuracy"]
      logging.info("step %d: held-out accuracy %.3f", done, accuracy)
    if int(t.checkpoint_every) and done % int(t.checkpoint_every) == 0 and more:
      run.meta.update(consumed_lib.meta(trainer.episodes, collective=True))
      run.ckpt.save(done, trainer.state, run.meta)
    if stop:
      logging.info("Step %d: %s.", done, stop)
      break


def _run(trainer: _Trainer, workdir: str) -> dict[str, float]:
  """Trains on the configured input, then the final checkpoint and eval."""
  run, start_step = trainer.run, int(trainer.state.step)
  if run.config.train.mode == "replay":
    inputs = contextlib.nullcontext(inputs_lib.replay(
        run, start_step=start_step, stop_step=trainer.total_steps))
  else:
    inputs = inputs_lib.live(
        run, workdir, params=trainer.state.policy_params,
        start_step=start_step, version=trainer.policy_version,
        consumed=trainer.episodes, stop_step=trainer.total_steps)
  with inputs as source:
    trainer.total_steps = source.stop_step
    try:
      _train(trainer, source)
    except BaseException:  # SIGTERM arrives as KeyboardInterrupt.
      finish_lib.save_on_exit(run.ckpt, trainer.state, run.meta,
                              trainer.meta_step, trainer.start_step)
      raise
    source.stop_sampler()  # Its final counts go into the summary.
    source.close_recorder()  # Before the final checkpoint covers its steps.
    run.meta.update(consumed_lib.meta(trainer.episodes, collective=True))
    return finish_lib.final_summary(
        run.ckpt, trainer.state, run.meta, start_step=start_step,
        version=trainer.policy_version(), evaluate=trainer.evaluate,
        stream_counters=source.stream.counters.as_dict(),
        sampler_stats=source.sampler and source.sampler.stats,
        clock=trainer.clock, episodes=trainer.episodes,
        unread_at_stop=source.unread_at_stop)


def train_and_evaluate(config: Any, workdir: str) -> dict[str, float]:
  """Runs SFT (if configured), asynchronous SAO RL and evaluation on a workdir
  no other run holds (``workdir_lock``); returns the summary: held-out accuracy
  before/after RL, steps, trajectories, tokens/s, staleness, ring, sampler."""
  setup_lib.local_batch_size(config)  # Fail before any compute.
  lock = workdir_lock.acquire(workdir)  # Refuses a workdir in use.
  workdir = lock.workdir
  # Process 0 writes the event file and summary.json (the losses are global;
  # ring, sampler and staleness figures are its host's).
  primary = jax.process_index() == 0
  writer = metrics_lib.MetricWriter(os.path.join(workdir, "tb"),
                                    active=primary)
  run = None
  try:
    run = setup_lib.build(config, workdir, writer, primary)
    trainer = _Trainer(run, writer, scores_dir=(
        os.path.join(workdir, "eval") if primary else None))
    if run.meta.get("eval_before") is None:
      run.meta["eval_before"] = trainer.evaluate(int(run.state.step), 0.0)
      logging.info("Held-out accuracy before RL: %.3f",
                   run.meta["eval_before"]["eval/accuracy"])
    trainer.catch_up_eval()
    with segment.sigterm_unwinds():
      summary = _run(trainer, workdir)
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
    lock.release()
