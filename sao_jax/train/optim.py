"""Optimizers for actor and critic: optax AdamW, schedules, clipping, frozen params.

The paper trains the critic faster than the actor (lr 5e-6 vs 1e-6) and optionally
with its attention frozen (paper §3.2, "practical value-model designs"): frozen
leaves get
``optax.set_to_zero`` through ``optax.multi_transform``, so they never move and
hold no Adam moments.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

# Substrings of a parameter path that mark it as an attention parameter.
ATTENTION_PATH_KEYS = ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj")
# `make_schedule`'s schedules after the warm-up (config.optim.schedule).
SCHEDULES = ("constant", "cosine")


def make_schedule(lr: float, *, warmup_steps: int, schedule: str,
                  total_steps: int) -> optax.Schedule:
  """Linear warm-up to ``lr``, then constant or cosine decay to 0 at total_steps."""
  if schedule == "constant":
    after = optax.constant_schedule(lr)
  elif schedule == "cosine":
    after = optax.cosine_decay_schedule(lr, max(1, total_steps - warmup_steps))
  else:
    raise ValueError(f"Unknown schedule {schedule!r}; use one of {SCHEDULES}.")
  if warmup_steps <= 0:
    return after
  warm = optax.linear_schedule(0.0, lr, warmup_steps)
  return optax.join_schedules([warm, after], [warmup_steps])


def path_is_attention(path: tuple[Any, ...]) -> bool:
  names = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
  return any(key in names for key in ATTENTION_PATH_KEYS)


def frozen_attention_labels(params: Any) -> Any:
  """Pytree of 'frozen'/'train' labels: attention leaves frozen, the rest trained."""
  return jax.tree_util.tree_map_with_path(
      lambda p, _: "frozen" if path_is_attention(p) else "train", params)


def make_optimizer(
    lr: float, *, warmup_steps: int = 0, schedule: str = "constant",
    total_steps: int = 1, weight_decay: float = 0.0, b1: float = 0.9,
    b2: float = 0.999, eps: float = 1e-8, grad_clip: float | None = 1.0,
    labels: Any | Callable[[Any], Any] | None = None,
) -> optax.GradientTransformation:
  """AdamW with warm-up schedule and global-norm clipping.

  Args:
    lr: Peak learning rate.
    warmup_steps: Linear warm-up length.
    schedule: 'constant' or 'cosine' after warm-up.
    total_steps: Length of the cosine decay horizon.
    weight_decay: Decoupled weight decay.
    b1: Adam beta1.
    b2: Adam beta2.
    eps: Adam epsilon.
    grad_clip: Global-norm clip; None or <= 0 disables.
    labels: Optional 'frozen'/'train' label pytree (or a function of params
      returning one), e.g. ``frozen_attention_labels``; frozen leaves get zero
      updates.

  Returns:
    An optax GradientTransformation.
  """
  sched = make_schedule(lr, warmup_steps=warmup_steps, schedule=schedule,
                        total_steps=total_steps)
  parts = []
  if grad_clip is not None and grad_clip > 0:
    parts.append(optax.clip_by_global_norm(grad_clip))
  parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps,
                           weight_decay=weight_decay))
  tx = optax.chain(*parts)
  if labels is None:
    return tx
  return optax.multi_transform(
      {"train": tx, "frozen": optax.set_to_zero()}, labels)
