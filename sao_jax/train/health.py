"""A run's health checks: non-finite steps and states, and its budgets.

The jitted step (``sao_jax.train.step``) skips an update whose losses,
gradient norms or parameters are not finite and reports ``health/skipped``.
``SkipGuard`` counts those skips on the host from the scalar the loop already
fetches every step, and stops the run after ``train.max_skipped_steps``
consecutive ones, naming the step and the first non-finite metric.
``nonfinite_leaves`` keeps a checkpoint with a NaN/Inf leaf from being
written. ``budget_spent`` says when the generated-token or time budget ends
the run before ``num_steps``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from absl import logging

from sao_jax import sharding


class NonFiniteError(RuntimeError):
  """The run produced non-finite numbers too many steps in a row."""


def first_nonfinite(metrics: Mapping[str, Any]) -> tuple[str, float] | None:
  """The first (sorted by name) metric that is NaN or Inf, with its value."""
  for name, value in sorted(jax.device_get(dict(metrics)).items()):
    value = float(value)
    if not math.isfinite(value):
      return name, value
  return None


class SkipGuard:
  """Counts skipped (non-finite) steps; raises after too many in a row.

  Attributes:
    skipped_total: Steps skipped so far in this process.
  """

  def __init__(self, max_consecutive: int):
    self._max = int(max_consecutive)
    self.skipped_total = 0
    self._run: list[int] = []  # Steps of the current run of skips.
    self._first_metrics: Mapping[str, Any] | None = None

  def observe(self, step: int, skipped: bool,
              metrics: Mapping[str, Any]) -> None:
    """Records train step ``step`` (1-based); raises ``NonFiniteError``."""
    if not skipped:
      self._run, self._first_metrics = [], None
      return
    self.skipped_total += 1
    if not self._run:
      self._first_metrics = metrics
    self._run.append(step)
    bad = first_nonfinite(self._first_metrics) or ("parameters", math.nan)
    logging.warning("Step %d: non-finite update skipped (%s=%s); %d in a row.",
                    step, bad[0], bad[1], len(self._run))
    if len(self._run) >= self._max:
      raise NonFiniteError(
          f"Step {step}: {len(self._run)} consecutive train steps "
          f"({self._run[0]}..{step}) produced non-finite numbers and were "
          f"skipped; the first non-finite metric, at step {self._run[0]}, was "
          f"{bad[0]}={bad[1]}. Lower optim.actor_lr / optim.critic_lr, keep "
          "optim.grad_clip on, or raise train.max_skipped_steps. The newest "
          "checkpoint holds the last finite state.")


@jax.jit
def _leaf_flags(tree: Any) -> list[jax.Array]:
  return [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]


def nonfinite_leaves(tree: Any) -> list[str]:
  """Paths of the floating-point leaves of ``tree`` holding a NaN or Inf."""
  leaves = [(jax.tree_util.keystr(p), x) for p, x in
            jax.tree_util.tree_leaves_with_path(tree)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  flags = jax.device_get(_leaf_flags([x for _, x in leaves]))
  return [path for (path, _), ok in zip(leaves, flags) if not ok]


def budget_spent(config: Any, generated: int, elapsed: float) -> str:
  """Why the run stops before ``num_steps`` ('' while it goes on). The time
  budget is process 0's clock on every host."""
  t = config.train
  tokens, seconds = int(t.max_generated_tokens), float(t.max_train_s)
  if tokens and generated >= tokens:
    return (f"generated-token budget reached: {generated} >= "
            f"train.max_generated_tokens={tokens}")
  if seconds and sharding.agreed(elapsed >= seconds):
    return (f"time budget reached: {elapsed:.0f} s >= "
            f"train.max_train_s={seconds:g}")
  return ""
