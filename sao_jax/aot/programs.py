"""Every program a run compiles, as abstract (shape-only) lowerings.

Built on the run's own builders, never copies of them (docs/design/pods.md
"Checking before renting"): the train state is ``step.create_train_state`` under
``jax.eval_shape`` with the optimizers of ``train.setup.optimizers`` and the
shardings ``sharding.param_shardings`` gives the params (optimizer moments
follow their params, ``optax.tree_map_params``; scalars are replicated, as in
``setup._train_state``); the steps are ``step.make_step`` (critic warm-up:
``update_policy=False``; the SAO step with its K critic updates) and
``sft.make_sft_step``; the batch has the fields and dtypes of
``data.trajectory.TOKEN_FIELDS`` / ``ROW_FIELDS``; the sampler's programs are
``sampler.decoding.append_chunk`` (prefill) and ``decoding.decode`` (one decode
chunk) at the shapes ``generate.Generator`` runs them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np
import optax

from sao_jax import sharding
from sao_jax.data import trajectory as traj_lib
from sao_jax.ipc import weights as weights_lib
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.rl import advantages as adv_lib
from sao_jax.sampler import decoding
from sao_jax.sampler import interface
from sao_jax.sampler import generate as generate_lib
from sao_jax.sampler import mesh as mesh_lib
from sao_jax.sampler import rollout
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.train import memory
from sao_jax.train import setup
from sao_jax.train import sft as sft_lib
from sao_jax.train import step as step_lib

Sds = jax.ShapeDtypeStruct


@dataclasses.dataclass
class Program:
  """One program to compile.

  Attributes:
    name: 'sft_step', 'critic_warmup_step', 'sao_step', 'sampler_prefill' or
      'sampler_decode'.
    role: 'trainer' or 'sampler' (whose chips it runs on).
    lower: () -> ``jax.stages.Lowered`` (called inside the right context).
    devices: chips the program spans.
    estimate: ``train/memory.py``'s per-chip bytes of what it holds.
    estimate_of: what ``estimate`` counts.
  """

  name: str
  role: str
  lower: Callable[[], Any]
  devices: int
  estimate: int
  estimate_of: str
  mesh: Any = None  # A sampler program's mesh (the trainer's: check.py's).


def model_config(config: Any) -> ModelConfig:
  """The run's ``ModelConfig`` (``setup.model_config``) without a
  tokenizer: the config's own ``model.vocab_size`` must be set."""
  if int(config.model.vocab_size) <= 0:
    raise ValueError("config.model.vocab_size=0 follows the tokenizer; set it "
                     "explicitly to compile ahead of time.")
  return setup.model_config(config)


def check_explicit_lengths(config: Any) -> None:
  """Lengths at 0 are derived from the task at run time; AOT needs them."""
  for key in ("sampler.max_new_tokens", "sampler.max_total_tokens",
              "train.max_seq_len"):
    section, name = key.split(".")
    if int(config[section][name]) <= 0:
      raise ValueError(f"config.{key}=0 is derived from the task when a run "
                       "starts; set it explicitly to compile ahead of time.")


def _with_sharding(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: Sds(x.shape, x.dtype, sharding=s), tree,
                      shardings)


def _moment_shardings(tx: optax.GradientTransformation, opt_state: Any,
                      param_shardings: Any, replicated: Any) -> Any:
  """Each optimizer leaf shaped like a param gets that param's sharding (as
  ``tx.init`` on sharded params gives it); the rest are replicated."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return optax.tree_map_params(
      tx, lambda leaf, s: leaf if masked(leaf) else s, opt_state,
      param_shardings, transform_non_params=lambda _: replicated,
      is_leaf=masked)


def abstract_train_state(config: Any, mcfg: ModelConfig,
                         step_cfg: step_lib.StepConfig,
                         mesh: jax.sharding.Mesh, rules: Any
                         ) -> tuple[step_lib.TrainState, Any, Any, Any]:
  """(abstract state with shardings, its shardings, actor tx, critic tx)."""
  p_boxed = setup._abstract_boxed(mcfg, False)  # pylint: disable=protected-access
  v_boxed = setup._abstract_boxed(mcfg, True)  # pylint: disable=protected-access
  p_shard = sharding.param_shardings(p_boxed, mesh, rules)
  v_shard = sharding.param_shardings(v_boxed, mesh, rules)
  policy = sharding.unbox(p_boxed)
  value = jax.eval_shape(functools.partial(
      transformer.value_params_from_policy, config=mcfg,
      rng=jax.random.PRNGKey(0)), policy)
  policy_tx, value_tx = setup.optimizers(config, value)
  running_mean = None
  if step_cfg.estimator == "running_mean":
    num_prompts = int(config.env.size)
    running_mean = jax.eval_shape(lambda: adv_lib.running_mean_init(
        1 if step_cfg.running_mean_global else num_prompts,
        int(config.rl.running_mean_k)))
  state = jax.eval_shape(
      lambda p, v: step_lib.create_train_state(
          p, v, policy_tx, value_tx, running_mean=running_mean,
          ref_params=p if step_cfg.uses_reference else None), policy, value)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rep = lambda tree: jax.tree.map(lambda _: replicated, tree)
  shardings = step_lib.TrainState(
      step=replicated, policy_version=replicated,
      policy_params=p_shard, value_params=v_shard,
      policy_opt_state=_moment_shardings(policy_tx, state.policy_opt_state,
                                         p_shard, replicated),
      value_opt_state=_moment_shardings(value_tx, state.value_opt_state,
                                        v_shard, replicated),
      running_mean=rep(state.running_mean),
      ref_params=p_shard if step_cfg.uses_reference else None)
  return (_with_sharding(state, shardings), shardings, policy_tx, value_tx)


def abstract_batch(config: Any, batch_sharding: Any,
                   mcfg: ModelConfig | None = None) -> dict[str, Sds]:
  """The [B, T] train batch (``trajectory.TOKEN_FIELDS`` / ``ROW_FIELDS``),
  and a MoE policy's recorded experts, int32 [B, T, M, k]."""
  b, t = int(config.train.batch_size), int(config.train.max_seq_len)
  batch = {name: Sds((b, t), np.dtype(dtype), sharding=batch_sharding)
           for name, (dtype, _) in traj_lib.TOKEN_FIELDS.items()}
  batch.update({name: Sds((b,), np.dtype(np.int32), sharding=batch_sharding)
                for name in traj_lib.ROW_FIELDS})
  if mcfg is not None and mcfg.moe is not None:
    batch["routed_experts"] = Sds((b, t, mcfg.num_moe_layers, mcfg.moe.top_k),
                                  np.dtype(np.int32), sharding=batch_sharding)
  return batch


def _mesh_shards(mesh: jax.sharding.Mesh) -> int:
  """Chips the state is split over (fsdp x tensor; data replicates it)."""
  return int(mesh.shape["fsdp"]) * int(mesh.shape["tensor"])


def train_programs(config: Any, mcfg: ModelConfig, mesh: jax.sharding.Mesh,
                   rules: Any) -> list[Program]:
  """The trainer's programs: SFT step (if the run has one), critic warm-up
  step (if ``rl.critic_warmup_steps`` > 0) and the SAO step."""
  step_cfg = setup.step_config_from(config)
  state, shardings, policy_tx, value_tx = abstract_train_state(
      config, mcfg, step_cfg, mesh, rules)
  batch = abstract_batch(config, sharding.batch_sharding(mesh, rules), mcfg)
  est = memory.log_memory_estimate(config, mcfg)
  state_est = (est.policy_params + est.policy_optimizer + est.critic_params +
               est.critic_optimizer) // _mesh_shards(mesh)
  n = mesh.devices.size
  programs = []
  if int(config.train.sft_steps) > 0 and not config.model.init_from:
    programs.append(_sft_program(config, mcfg, mesh, est))
  for name, update_policy in (("critic_warmup_step", False),
                              ("sao_step", True)):
    if not update_policy and int(config.rl.critic_warmup_steps) <= 0:
      continue
    fn = step_lib.make_step(mcfg, step_cfg, policy_tx, value_tx,
                            update_policy=update_policy,
                            state_sharding=shardings,
                            batch_sharding=sharding.batch_sharding(mesh, rules))
    programs.append(Program(
        name, "trainer", functools.partial(fn.lower, state, batch), n,
        state_est, "params + AdamW moments of policy and critic per chip "
        "(no activations)"))
  return programs


def _sft_program(config: Any, mcfg: ModelConfig, mesh: jax.sharding.Mesh,
                 est: memory.MemoryEstimate) -> Program:
  """The SFT step as ``warm_start`` runs it: unsharded, on one chip."""
  t = config.train
  cfg = sft_lib.SFTConfig(steps=int(t.sft_steps),
                          batch_size=int(t.sft_batch_size),
                          max_len=int(t.sft_max_len), lr=float(t.sft_lr))
  tx = sft_lib.sft_optimizer(cfg)
  one = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
  params = sharding.unbox(setup._abstract_boxed(mcfg, False))  # pylint: disable=protected-access
  opt_state = jax.eval_shape(tx.init, params)
  shape = (cfg.batch_size, cfg.max_len)
  batch = {"tokens": Sds(shape, jnp.int32, sharding=one),
           "attention_mask": Sds(shape, jnp.bool_, sharding=one),
           "loss_mask": Sds(shape, jnp.float32, sharding=one)}
  place = lambda tree: jax.tree.map(
      lambda x: Sds(x.shape, x.dtype, sharding=one), tree)
  fn = sft_lib.make_sft_step(mcfg, tx)
  return Program("sft_step", "trainer",
                 functools.partial(fn.lower, place(params), place(opt_state),
                                   batch), 1,
                 est.policy_params + est.policy_optimizer,
                 "policy params + AdamW moments (one chip, as warm_start runs "
                 "it)")


def sampler_shapes(config: Any) -> dict[str, int]:
  """Batch, cache, prefill and decode-chunk lengths the sampler runs."""
  limits = rollout.RolloutLimits.from_config(config)
  opts = interface.EngineOptions.from_config(config)
  prompt = max(1, limits.max_total_tokens - limits.max_new_tokens_per_turn)
  if str(config.sampler.kv_on_swap) == "recompute":
    prompt = limits.cache_len()  # A swap re-prefills whole histories.
  return {
      "slots": opts.num_slots,
      "prefill_rows": generate_lib.rows_per_prefill(opts.prefill_rows,
                                                    opts.num_slots),
      "cache_len": limits.cache_len(),
      "prefill_len": generate_lib.bucket_length(prompt,
                                                limits.min_prompt_bucket),
      "decode_steps": generate_lib.bucket_length(
          min(opts.decode_chunk, limits.max_new_tokens_per_turn)),
  }


def weight_slot_bytes(mcfg: ModelConfig) -> int:
  """Shared-memory bytes of the weight slot (host RAM, both buffers)."""
  return weights_lib.slot_bytes(
      sharding.unbox(setup._abstract_boxed(mcfg, False)))  # pylint: disable=protected-access


def sampler_programs(config: Any, mcfg: ModelConfig,
                     devices: Sequence[Any]) -> list[Program]:
  """The sampler's prefill and decode chunk over ``sampler.mesh`` laid on
  ``devices`` (its block of chips), placed as the sampler places them
  (`sampler/mesh.py`: weights by the rules, the cache by its axes, the
  inputs replicated), lowered under the mesh and rules."""
  smesh = mesh_lib.SamplerMesh.build(mesh_lib.mesh_sizes(config),
                                     config.mesh.rules, devices=devices)
  everywhere = NamedSharding(smesh.mesh, PartitionSpec())
  placed = lambda tree, shardings: jax.tree.map(
      lambda x, s: Sds(x.shape, x.dtype, sharding=s), tree, shardings)
  shapes = sampler_shapes(config)
  b = shapes["slots"]
  params = placed(sharding.unbox(setup._abstract_boxed(mcfg, False)),  # pylint: disable=protected-access
                  smesh.param_shardings(mcfg))
  state = jax.eval_shape(functools.partial(
      decoding.init_state, mcfg, b, shapes["cache_len"]))
  state = placed(state, smesh.state_shardings(state))
  est = memory.estimate_memory(mcfg, kv_batch=b, kv_len=shapes["cache_len"],
                               critic=False)
  held = est.policy_params + est.kv_cache
  what = (f"policy params + KV cache (whole, over {smesh.size} chip"
          f"{'s' if smesh.size > 1 else ''})")
  row = lambda dtype, *rest: Sds((b, *rest), dtype, sharding=everywhere)
  fed = lambda dtype, *rest: Sds((shapes["prefill_rows"], *rest), dtype,
                                 sharding=everywhere)
  tokens, mask = fed(jnp.int32, shapes["prefill_len"]), fed(
      jnp.bool_, shapes["prefill_len"])
  sampling = SamplingParams(temperature=float(config.sampler.temperature),
                            top_p=float(config.sampler.top_p),
                            top_k=int(config.sampler.top_k))
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  key = placed(key, jax.tree.map(lambda _: everywhere, key))

  def under_mesh(lower: Callable[[], Any]) -> Callable[[], Any]:
    def run():
      with smesh.context():
        return lower()
    return run

  if shapes["prefill_rows"] < b:  # As the sampler feeds them: some rows.
    prefill = under_mesh(functools.partial(
        decoding.append_rows.lower, params, mcfg, state, fed(jnp.int32),
        tokens, mask))
  else:
    prefill = under_mesh(functools.partial(
        decoding.append_chunk.lower, params, mcfg, state, tokens, mask))
  decode = under_mesh(functools.partial(
      decoding.decode.lower, params, mcfg, state, key,
      row(jnp.int32, 2), row(jnp.bool_), row(jnp.int32),
      row(jnp.uint32, 2), max_new_tokens=shapes["decode_steps"],
      sampling=sampling))
  return [Program("sampler_prefill", "sampler", prefill, smesh.size, held,
                  what, smesh.mesh),
          Program("sampler_decode", "sampler", decode, smesh.size, held,
                  what, smesh.mesh)]
