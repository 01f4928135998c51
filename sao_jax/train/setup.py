"""What the loop starts from, built from the config (docs/design/overview.md
"The shape").

``build(config, workdir, writer)`` makes, in this order: the tokenizer, the
tasks, the config resolved for them (``envs.task_sizing``: settings at 0
derived from the task, explicit ones checked), the model config, the mesh, the initial policy (``warm_start``) and
its critic, the two optimizers, the train state in its mesh shardings
(restored from the newest checkpoint in ``workdir/checkpoints`` if there is
one, into an abstract state: no initial policy is built) and the jitted step
functions.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import optax
from absl import logging

from sao_jax import sharding
from sao_jax.tokenization import text_tokenizer
from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.data import packing
from sao_jax.envs import build as env_build
from sao_jax.envs import reasoning_gym_env
from sao_jax.envs import task_sizing
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.rl import advantages as adv_lib
from sao_jax.rl import registry
from sao_jax.train import checkpoint as ckpt_lib
from sao_jax.train import memory
from sao_jax.train import metrics as metrics_lib
from sao_jax.train import optim
from sao_jax.train import step as step_lib
from sao_jax.train import warm_start

StepFn = Callable[[step_lib.TrainState, Any], tuple[step_lib.TrainState, Any]]


def model_config(config: Any) -> ModelConfig:
  """``ModelConfig`` from ``config.model`` (``model.moe`` with 0 experts: a
  dense model)."""
  return ModelConfig.from_config(config.model)


def model_config_from(config: Any, tokenizer: text_tokenizer.TextTokenizer
                      ) -> ModelConfig:
  """``model_config(config)``, whose vocabulary fits the tokenizer."""
  mcfg = model_config(config)
  if mcfg.vocab_size < tokenizer.vocab_size:
    raise ValueError(
        f"config.model.vocab_size={mcfg.vocab_size} < tokenizer vocab "
        f"{tokenizer.vocab_size}; raise config.model.vocab_size.")
  return mcfg


def run_tokenizer(config: Any, workdir: str,
                  primary: bool) -> text_tokenizer.TextTokenizer:
  """The run's tokenizer (``tokenizer_from_config``), one for all processes.

  In a multi-host run process 0 trains (or loads) it first and the others
  wait at a barrier, then load the file it wrote to the shared workdir, so
  every host maps text to the same ids.
  """
  def load():
    return tok_lib.tokenizer_from_config(config.tokenizer, workdir, config.env)

  if jax.process_count() == 1:
    return load()
  tokenizer = load() if primary else None
  multihost_utils.sync_global_devices("sao_jax tokenizer ready")
  return tokenizer or load()


def local_batch_size(config: Any) -> int:
  """This host's rows per step; whole sampler batches, so sync can alternate."""
  local_batch = int(config.train.batch_size) // jax.process_count()
  n_roll = int(config.sampler.n_rollouts)
  episodes_per_batch = max(1, int(config.sampler.batch_size) // n_roll) * n_roll
  if local_batch % episodes_per_batch:
    raise ValueError(
        f"train.batch_size/process_count={local_batch} must be a multiple of "
        f"the sampler's episodes per batch ({episodes_per_batch} = "
        "sampler.batch_size rounded down to a multiple of n_rollouts); "
        "otherwise sync mode cannot alternate.")
  return local_batch


def optimizers(config: Any, value_params: Any
               ) -> tuple[optax.GradientTransformation,
                          optax.GradientTransformation]:
  """(actor, critic) AdamW from ``config.optim``.

  Both share every ``config.optim`` key but their learning rates
  (``actor_lr``, ``critic_lr``). The critic's schedule also spans the critic
  warm-up steps; with ``rl.critic_frozen_attention`` its attention is frozen.
  """
  shared = {k: v for k, v in config.optim.items() if not k.endswith("_lr")}
  num_steps = int(config.train.num_steps)
  policy_tx = optim.make_optimizer(float(config.optim.actor_lr),
                                   total_steps=num_steps, **shared)
  labels = (optim.frozen_attention_labels(value_params)
            if config.rl.critic_frozen_attention else None)
  value_tx = optim.make_optimizer(
      float(config.optim.critic_lr),
      total_steps=int(config.rl.critic_warmup_steps) + num_steps,
      labels=labels, **shared)
  return policy_tx, value_tx


def step_config_from(config: Any) -> step_lib.StepConfig:
  """The step's static settings, the loss's estimator resolved here:
  ``rl.advantage``, else the one the loss is registered with; loss hparams are
  the loss's registered keys."""
  rl = config.rl
  loss = str(rl.loss)
  spec = registry.get_spec(loss)
  hparams = tuple(sorted((k, rl[k]) for k in spec.defaults
                         if rl.get(k) is not None))
  return step_lib.StepConfig(
      loss=loss, loss_hparams=hparams,
      advantage=rl.advantage or spec.advantage,
      gamma=float(rl.gamma), lam_critic=float(rl.lam_critic),
      lam_policy_alpha=float(rl.lam_policy_alpha),
      critic_updates_per_step=int(rl.critic_updates_per_step),
      temperature=float(config.sampler.temperature),
      value_clip=rl.value_clip,
      max_groups=packing.trajectories_per_step_bound(config),
      routing_replay=str(config.model.routing_replay) == "rollout",
      router_aux_loss_coef=float(config.model.router_aux_loss_coef),
      running_mean_global=rl.running_mean_scope == "global")


def _abstract_boxed(mcfg: ModelConfig, value: bool) -> Any:
  tok = jnp.zeros((1, 1), jnp.int32)
  module = transformer.ValueModel(mcfg) if value else transformer.Transformer(
      mcfg)
  return jax.eval_shape(
      lambda: module.init(jax.random.PRNGKey(0), tok, tok, tok == 0))["params"]


@dataclasses.dataclass
class Setup:
  """Everything ``build`` makes; ``meta`` is what the checkpoint carries."""

  config: Any
  tokenizer: text_tokenizer.TextTokenizer
  mcfg: ModelConfig
  train_tasks: reasoning_gym_env.ReasoningGymTasks
  eval_tasks: reasoning_gym_env.ReasoningGymTasks
  mesh: jax.sharding.Mesh
  rules: Any
  state: step_lib.TrainState
  ckpt: ckpt_lib.Checkpointer
  meta: dict[str, Any]
  critic_only_step: StepFn  # Critic warm-up: the policy does not move.
  full_step: StepFn  # Critic updates and one policy update.


def _new_state(config: Any, step_cfg: step_lib.StepConfig, num_prompts: int,
               policy_params: Any, value_params: Any,
               policy_tx: optax.GradientTransformation,
               value_tx: optax.GradientTransformation) -> step_lib.TrainState:
  """A step-0 state over these (unboxed) params: optimizer moments made where
  the params are (sharded params, sharded moments), the running mean, and the
  KL penalty's frozen reference (a copy: the step donates the state)."""
  running_mean = None
  if step_cfg.estimator == "running_mean":
    running_mean = adv_lib.running_mean_init(
        1 if step_cfg.running_mean_global else num_prompts,
        int(config.rl.running_mean_k))
  ref_params = (jax.tree.map(jnp.copy, policy_params)
                if step_cfg.uses_reference else None)
  return step_lib.create_train_state(policy_params, value_params, policy_tx,
                                     value_tx, running_mean=running_mean,
                                     ref_params=ref_params)


def _value_params(config: Any, mcfg: ModelConfig, policy_params: Any) -> Any:
  return transformer.value_params_from_policy(
      policy_params, mcfg, jax.random.PRNGKey(int(config.train.seed) + 7),
      head_std=float(config.rl.value_head_init_std))


def _state_shardings(abstract: step_lib.TrainState, p_shard: Any, v_shard: Any,
                     policy_tx: optax.GradientTransformation,
                     value_tx: optax.GradientTransformation,
                     mesh) -> step_lib.TrainState:
  """Where each leaf of the state lives: params (and the reference) in their
  mesh shardings, each optimizer leaf that mirrors a param (Adam's moments)
  in that param's (``optax.tree_map_params``), and scalars (step, version,
  Adam counts, the running mean) replicated over the mesh (not one local
  device, which would break multi-host runs)."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def opt(tx, opt_state, shardings):
    # A masked (frozen) param's place in the state holds no array.
    masked = lambda x: isinstance(x, optax.MaskedNode)
    return optax.tree_map_params(
        tx, lambda x, s: x if masked(x) else s, opt_state, shardings,
        transform_non_params=lambda _: replicated, is_leaf=masked)

  return step_lib.TrainState(
      step=replicated, policy_version=replicated, policy_params=p_shard,
      value_params=v_shard,
      policy_opt_state=opt(policy_tx, abstract.policy_opt_state, p_shard),
      value_opt_state=opt(value_tx, abstract.value_opt_state, v_shard),
      running_mean=jax.tree.map(lambda _: replicated, abstract.running_mean),
      ref_params=None if abstract.ref_params is None else p_shard)


def _train_state(config: Any, mcfg: ModelConfig, step_cfg: step_lib.StepConfig,
                 policy_params: Any | None, num_prompts: int, mesh, rules
                 ) -> tuple[step_lib.TrainState, Any, Any, Any]:
  """(state in its mesh shardings, its shardings, actor tx, critic tx).

  ``policy_params`` None (a run that restores a checkpoint): the state is
  abstract, ``jax.ShapeDtypeStruct`` leaves with their shardings, the
  restore's target: nothing is initialised only to be overwritten.
  """
  boxed_policy = _abstract_boxed(mcfg, False)
  p_shard = sharding.param_shardings(boxed_policy, mesh, rules)
  v_shard = sharding.param_shardings(_abstract_boxed(mcfg, True), mesh, rules)
  abstract_policy = nn.unbox(boxed_policy)
  abstract_value = jax.eval_shape(
      lambda p: _value_params(config, mcfg, p), abstract_policy)
  policy_tx, value_tx = optimizers(config, abstract_value)
  abstract = jax.eval_shape(
      lambda p, v: _new_state(config, step_cfg, num_prompts, p, v,
                              policy_tx, value_tx),
      abstract_policy, abstract_value)
  state_sharding = _state_shardings(abstract, p_shard, v_shard, policy_tx,
                                    value_tx, mesh)
  if policy_params is None:
    return (jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract, state_sharding), state_sharding, policy_tx, value_tx)
  value_params = sharding.shard_params(
      _value_params(config, mcfg, policy_params), v_shard)
  policy_params = sharding.shard_params(policy_params, p_shard)
  state = _new_state(config, step_cfg, num_prompts, policy_params,
                     value_params, policy_tx, value_tx)
  return (jax.device_put(state, state_sharding), state_sharding, policy_tx,
          value_tx)


def run_artifacts_dir(config: Any, workdir: str) -> str:
  """Where the tokenizer and the SFT warm start live: a replay (train.mode
  'replay') uses the recorded run's, so it starts from the same policy."""
  if str(config.train.mode) == "replay":
    return os.path.abspath(str(config.train.replay_from))
  return workdir


def _replay_start(config: Any) -> tuple[ckpt_lib.Checkpointer | None,
                                        int | None]:
  """(the recorded run's checkpointer, its newest step <= a) for a replay of
  ``train.replay_steps`` [a, b); (None, None): start from step 0."""
  window = tuple(config.train.replay_steps)
  if str(config.train.mode) != "replay" or not window:
    return None, None
  directory = os.path.join(str(config.train.replay_from), "checkpoints")
  if not os.path.isdir(directory):
    return None, None
  source = ckpt_lib.Checkpointer(directory)
  steps = [s for s in source.all_steps() if s <= int(window[0])]
  if not steps:
    source.close()
    return None, None
  return source, steps[-1]


def build(config: Any, workdir: str, writer: metrics_lib.MetricWriter,
          primary: bool) -> Setup:
  """Builds the run (see the module docstring); resumes if it can.

  A replay without checkpoints of its own starts from the recorded run's
  checkpoint at or before ``train.replay_steps[0]`` (if any).
  """
  artifacts = run_artifacts_dir(config, workdir)
  tokenizer = run_tokenizer(config, artifacts, primary)
  train_tasks, eval_tasks = env_build.build_tasks(config.env)
  # Lengths and the model vocabulary at 0 follow the task; explicit ones are
  # checked against it. The run uses the resolved config from here on.
  config = task_sizing.resolve(config, tokenizer, (train_tasks, eval_tasks))
  mcfg = model_config_from(config, tokenizer)
  memory.log_memory_estimate(config, mcfg)
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.normalize_rules(config.mesh.rules)
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  source, source_step = (ckpt, None) if ckpt.latest_step() is not None else (
      _replay_start(config))
  # A resumed run's state comes from its checkpoint: no initial policy (no
  # checkpoint load, random init or SFT warm start) and an abstract state.
  policy_params = None if source is not None else warm_start.initial_policy(
      config, mcfg, tokenizer, train_tasks, eval_tasks, artifacts, writer)
  step_cfg = step_config_from(config)
  state, state_sharding, policy_tx, value_tx = _train_state(
      config, mcfg, step_cfg, policy_params, len(train_tasks), mesh, rules)

  meta: dict[str, Any] = {"episodes_consumed": 0, "stream": {},
                          "eval_before": None}
  if source is not None:
    # Restored straight into the mesh shardings (each host reads its shards).
    state, meta, step0 = (ckpt.restore_newest(state) if source is ckpt else
                          source.restore(state, source_step))
    logging.info("Resumed from checkpoint step %d (policy version %d).",
                 step0, int(state.policy_version))
    if source is not ckpt:
      logging.info("(The recorded run's checkpoint, in %s.)", source.directory)
      source.close()
  step_fns = [step_lib.make_step(
      mcfg, step_cfg, policy_tx, value_tx, update_policy=update_policy,
      state_sharding=state_sharding,
      batch_sharding=sharding.batch_sharding(mesh, rules))
              for update_policy in (False, True)]
  return Setup(config, tokenizer, mcfg, train_tasks, eval_tasks, mesh, rules,
               state, ckpt, meta, *step_fns)
