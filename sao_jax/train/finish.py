"""How a run ends: the final checkpoint and summary, or a save on the way out.

A run that completes saves its last step (if no checkpoint holds it yet) and
returns ``metrics.run_summary`` with the final held-out evaluation. A run
stopped by SIGTERM or an error first checkpoints its last completed step, so
at most the step in flight is lost (docs/design/failures.md).
"""

from __future__ import annotations

from typing import Any, Callable

from absl import logging
import jax

from sao_jax.ipc import segment
from sao_jax.train import checkpoint as ckpt_lib
from sao_jax.train import metrics as metrics_lib


def save_on_exit(ckpt: ckpt_lib.Checkpointer, state: Any, meta: dict,
                 meta_step: int, start_step: int) -> None:
  """Checkpoints ``state`` if it is a completed step newer than the last save.

  ``meta_step`` is the step of the state ``meta`` goes with (the loop records
  a batch's consumption with its step's new state, so a stop before the step
  leaves the batch out of the checkpoint, to be generated again); a state at
  another step is not saved. Never raises an error (the run is already
  failing); never a NaN state (``Checkpointer.save`` refuses those). A second
  SIGTERM (a launcher that signals the whole process group, an impatient
  user) waits for the save to finish, then unwinds.
  """
  if jax.process_count() > 1:  # A save is collective: peers may be gone.
    logging.warning("Multi-host run stopped: no checkpoint on the way out; "
                    "the newest is step %s.", ckpt.latest_step())
    return
  with segment.sigterm_deferred():
    try:
      step = int(state.step)
      if step != meta_step:
        logging.warning("Stopped inside step %d: no checkpoint on the way "
                        "out.", step)
      elif step > start_step and step != ckpt.latest_step():
        logging.warning("Run stopped: saving step %d before exiting.", step)
        ckpt.save(step, state, meta)
    except Exception:  # pylint: disable=broad-except
      logging.exception("Could not save a checkpoint on the way out.")


def final_summary(ckpt: ckpt_lib.Checkpointer, state: Any, meta: dict, *,
                  start_step: int, version: int,
                  evaluate: Callable[[int, float], dict[str, float]],
                  stream_counters: dict[str, Any], sampler_stats: Any,
                  clock: metrics_lib.RunClock, episodes: Any = None,
                  unread_at_stop: int | None = None) -> dict[str, float]:
  """Saves the final step, evaluates it and returns the run's summary.

  ``evaluate(step, generated_tokens)`` is the held-out evaluation;
  ``sampler_stats`` is None in a replay (no sampler figures), as is
  ``unread_at_stop`` (records left in the ring); ``episodes`` this host's
  ``consumed.ConsumedEpisodes``.
  """
  final_step = int(state.step)
  if final_step > start_step or ckpt.latest_step() != final_step:
    ckpt.save(final_step, state, meta)
  generated = stream_counters["action_tokens_read"] * jax.process_count()
  final_eval = evaluate(final_step, float(generated))
  return metrics_lib.run_summary(
      meta["eval_before"], final_eval, final_step, version, stream_counters,
      jax.process_count(), sampler_stats, clock, episodes=episodes,
      unread_at_stop=unread_at_stop)
