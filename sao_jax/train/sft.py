"""Supervised warm start on task solutions (the paper RL-trains an SFT checkpoint).

Examples are segment lists (prompt, actions, observations) encoded with the
same template the sampler uses; the loss is the token-mean negative
log-likelihood of the action tokens only (never the prompt or a tool result). Batches come from a grain ``MapDataset`` (shuffled,
repeated, padded per example, batched), the optimizer is optax AdamW.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from sao_jax.models import logprobs as logprobs_lib
from sao_jax.models import transformer
from sao_jax.data import stream
from sao_jax.models.config import ModelConfig
from sao_jax.train import optim


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  steps: int = 300
  batch_size: int = 64
  max_len: int = 64
  lr: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  seed: int = 0
  log_every: int = 50
  # Also log once this many seconds have passed since the last log (0: off),
  # so a slow step (a 135M model on CPU: ~25 s) still shows progress.
  log_every_s: float = 60.0


# One SFT example: segments of token ids, each trained on (policy actions) or
# not (prompt, environment observations such as tool results).
Example = Sequence[tuple[Sequence[int], bool]]


def encode_segments(segments: Example, max_len: int,
                    pad_id: int = 0) -> dict[str, np.ndarray]:
  """Right-pads one example to ``max_len``; ``loss_mask`` marks target tokens.

  Raises:
    ValueError: The example does not fit in ``max_len`` (never silently cut).
  """
  ids = [int(t) for seg, _ in segments for t in seg]
  target = [float(train) for seg, train in segments for _ in seg]
  if len(ids) > max_len:
    raise ValueError(
        f"SFT example of {len(ids)} tokens exceeds max_len={max_len}; raise "
        "sft max_len or shorten the task's prompts.")
  tokens = np.full((max_len,), pad_id, np.int32)
  tokens[:len(ids)] = ids
  attn = np.zeros((max_len,), np.bool_)
  attn[:len(ids)] = True
  loss_mask = np.zeros((max_len,), np.float32)
  loss_mask[:len(ids)] = target
  return {"tokens": tokens, "attention_mask": attn, "loss_mask": loss_mask}


def encode_example(prompt_ids: Sequence[int], completion_ids: Sequence[int],
                   max_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
  """A single-turn example: train on the completion only."""
  return encode_segments([(prompt_ids, False), (completion_ids, True)],
                         max_len, pad_id)


def sft_dataset(examples: Sequence[Example], cfg: SFTConfig,
                pad_id: int = 0) -> grain.IterDataset:
  """Shuffled, repeated, padded, batched grain pipeline over the examples."""
  return (
      grain.MapDataset.source(list(examples))
      .shuffle(seed=cfg.seed)
      .repeat()
      .map(lambda ex: encode_segments(ex, cfg.max_len, pad_id))
      .batch(cfg.batch_size, drop_remainder=True)
      .to_iter_dataset(stream.IN_MEMORY))


def nll_loss(model: transformer.Transformer, params: Any,
             batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, Any]]:
  """Token-mean NLL of ``loss_mask`` tokens (next-token prediction).

  The log-probs come in chunks of ``model.logits_chunk`` positions when set
  (``models.logprobs.policy_token_stats``), as in the RL step.
  """
  tokens = batch["tokens"]
  positions = transformer.positions_from_mask(batch["attention_mask"])
  stats = logprobs_lib.policy_token_stats(
      params, model.config, tokens, positions, batch["attention_mask"],
      with_entropy=False, with_argmax=True)
  mask = batch["loss_mask"][:, 1:]
  n = jnp.maximum(mask.sum(), 1.0)
  loss = -(stats["logp"][:, 1:] * mask).sum() / n
  # argmax[:, t] is the prediction made at t - 1 for token t.
  correct = (stats["argmax"][:, 1:] == tokens[:, 1:]).astype(jnp.float32)
  return loss, {"sft/loss": loss, "sft/token_accuracy": (correct * mask).sum() / n}


def sft_optimizer(cfg: SFTConfig) -> optax.GradientTransformation:
  """AdamW with warm-up and cosine decay over ``cfg.steps``."""
  return optim.make_optimizer(
      cfg.lr, warmup_steps=cfg.warmup_steps, schedule="cosine",
      total_steps=cfg.steps, weight_decay=cfg.weight_decay,
      grad_clip=cfg.grad_clip)


def make_sft_step(model_config: ModelConfig, tx: optax.GradientTransformation
                  ) -> Callable[..., tuple[Any, Any, dict[str, Any]]]:
  """The jitted step ``(params, opt_state, batch) -> (params, opt_state,
  metrics)`` (also compiled ahead of time by ``sao_jax.aot``)."""
  model = transformer.Transformer(model_config)

  @jax.jit
  def step(params, opt_state, batch):
    (_, metrics), grads = jax.value_and_grad(
        lambda p: nll_loss(model, p, batch), has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics

  return step


def run_sft(model_config: ModelConfig, params: Any,
            examples: Sequence[Example], cfg: SFTConfig, *, pad_id: int = 0,
            on_metrics: Callable[[int, dict[str, float]], None] | None = None,
            ) -> tuple[Any, dict[str, float]]:
  """Trains ``params`` on ``examples`` for ``cfg.steps`` steps; returns new params.

  Args:
    model_config: The policy's architecture.
    params: Initial (unboxed) policy params.
    examples: Segment lists (see ``Example``).
    cfg: SFT hyperparameters.
    pad_id: Padding token id.
    on_metrics: Called every ``log_every`` steps (and after ``log_every_s``
      seconds without a call) with (step, metrics).

  Returns:
    (trained params, last metrics).
  """
  if not examples:
    raise ValueError("run_sft got no examples; check the task/env config.")
  tx = sft_optimizer(cfg)
  opt_state = tx.init(params)
  step = make_sft_step(model_config, tx)
  it = iter(sft_dataset(examples, cfg, pad_id))
  metrics: dict[str, float] = {}
  start = last_log = time.time()
  in_flight = None
  for i in range(1, cfg.steps + 1):
    batch = next(it)
    params, opt_state, m = step(params, opt_state, batch)
    # At most one step queued behind the running one: without this, JAX's
    # async dispatch lets the loop run tens of steps ahead of the device,
    # and the clock below would measure dispatch, not progress.
    if in_flight is not None:
      jax.block_until_ready(in_flight)
    in_flight = m
    now = time.time()
    due = cfg.log_every_s > 0 and now - last_log >= cfg.log_every_s
    if i % cfg.log_every == 0 or i == cfg.steps or due:
      last_log = now
      metrics = {k: float(v) for k, v in m.items()}
      metrics["sft/steps_per_s"] = i / (time.time() - start)
      logging.info("SFT step %d/%d: %s", i, cfg.steps, metrics)
      if on_metrics is not None:
        on_metrics(i, metrics)
  return params, metrics
