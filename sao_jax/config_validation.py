"""Checks an experiment config before any compute starts.

The reference is `configs/base.py`: a config may only hold keys that exist
there, of the same types (`config_keys`), with values in range and consistent
with each other. A setting's range is defined once, next to the code that
uses it (`ranges`): the fields of the dataclasses built from the config at
start-up (``ModelConfig``, ``EngineOptions``, ``SamplingParams``, the
sandbox's ``Limits``) are checked with their own tables, and ``ModelConfig``
itself is built; this module holds the other keys' ranges and the rules
across keys. Every failure raises `ConfigError` whose message is one line
naming the key, e.g.

  config.rl.eps_low: expected float in (0, 1), got 1.5
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Callable

import ml_collections

from sao_jax import ranges
from sao_jax import reasoning_gym_import
# Re-exported: the key tree's API is used from here.
from sao_jax.config_keys import base_config
from sao_jax.config_keys import check_key_path  # pylint: disable=unused-import
from sao_jax.config_keys import check_key_tree
from sao_jax.config_keys import ConfigError
from sao_jax.config_keys import FREE_FORM  # pylint: disable=unused-import
from sao_jax.config_keys import get_path
from sao_jax.models import config as model_config

TRAIN_MODES = ("async", "sync", "group", "replay")
# model.routing_replay: R3 (the sampler's recorded experts) or the trainer's
# own routing (docs/design/models.md "Routing replay (R3): what the sampler
# records").
ROUTING_REPLAY = ("off", "rollout")

Rule = ranges.Rule
_POS, _NONNEG, _GT0 = ranges.POSITIVE, ranges.NONNEG, ranges.GT0
_FINITE_GT0, _UNIT, _in = ranges.FINITE_GT0, ranges.UNIT, ranges.one_of
# Settings that may follow the task (0 = derive; sao_jax.envs.task_sizing).
_DERIVABLE = Rule(lambda v: isinstance(v, int) and v >= 0,
                  "a positive int, or 0 to derive it from the task")
_BETA = Rule(lambda v: 0 <= v < 1, "float in [0, 1)")

# One-key checks of the keys no start-up dataclass checks: dotted key -> rule.
_RANGES: dict[str, Rule] = {
    "model.routing_replay": _in(ROUTING_REPLAY),
    "env.size": _POS, "env.eval_size": _POS, "env.max_turns": _POS,
    "env.max_tool_calls": _NONNEG, "env.step_timeout_s": _FINITE_GT0,
    "env.code_workers": _POS,
    "env.code_observation_chars": Rule(lambda v: isinstance(v, int) and v >= 64,
                                       "an int >= 64"),
    "sampler.max_new_tokens": _DERIVABLE,
    "sampler.max_total_tokens": _DERIVABLE,
    "sampler.min_prompt_bucket": _POS, "sampler.batch_size": _POS,
    "sampler.max_restarts": _NONNEG, "sampler.restart_window_s": _GT0,
    "sampler.max_restarts_per_window": _NONNEG,
    "env.longtail_min_tokens": _POS, "env.longtail_levels": _POS,
    "env.longtail_tool_calls": _NONNEG, "env.longtail_tool_latency_s": Rule(
        lambda v: 0 <= v < math.inf, "a finite float >= 0"),
    "rl.eps_low": Rule(lambda v: v is None or 0 < v <= 1,
                       "None (the loss's default) or a float in (0, 1]"),
    "rl.eps_high": Rule(lambda v: v is None or v > 0,
                        "None (the loss's default) or a float > 0"),
    "rl.kl_coef": Rule(lambda v: v >= 0, "float >= 0"),
    "rl.gamma": _UNIT, "rl.lam_critic": _UNIT, "rl.lam_policy_alpha": _GT0,
    "rl.running_mean_k": _POS,
    "rl.running_mean_scope": Rule(lambda v: v in ("prompt", "global"),
                                  "'prompt' or 'global'"),
    "rl.critic_warmup_steps": _NONNEG, "rl.critic_updates_per_step": _POS,
    "rl.value_head_init_std": Rule(lambda v: 0 <= v < math.inf,
                                   "a finite float >= 0 (0: a zero kernel)"),
    "rl.value_clip": Rule(lambda v: v is None or v > 0, "None or float > 0"),
    "optim.actor_lr": _FINITE_GT0, "optim.critic_lr": _FINITE_GT0,
    "optim.grad_clip": Rule(lambda v: v == 0 or 0 < v < math.inf,
                            "a finite float > 0 (global-norm clip) or 0 (no "
                            "clipping)"),
    "optim.warmup_steps": _NONNEG,
    "optim.weight_decay": Rule(lambda v: v >= 0, "float >= 0"),
    "optim.b1": _BETA, "optim.b2": _BETA, "optim.eps": _GT0,
    "train.mode": _in(TRAIN_MODES),
    **{f"train.{k}": _POS for k in (
        "num_steps", "batch_size", "publish_every", "eval_batch_size",
        "log_every", "sft_batch_size", "max_skipped_steps",
        "record_shard_steps", "pack_max_segments")},
    "train.max_seq_len": _DERIVABLE, "train.sft_max_len": _DERIVABLE,
    **{f"train.{k}": _NONNEG for k in (
        "max_staleness", "eval_every", "checkpoint_every", "sft_steps",
        "publish_lag", "max_generated_tokens", "sft_seed")},
    "train.max_train_s": _NONNEG,
    "train.sft_lr": _FINITE_GT0, "train.max_error_frac": _UNIT,
    "train.sft_tool_frac": _UNIT,
    "ring.capacity_bytes": _POS, "ring.put_timeout_s": _GT0,
    "ring.get_timeout_s": _GT0,
    "distributed.num_processes": Rule(lambda v: v is None or v >= 1,
                                      "None or int >= 1"),
}


def _fail(path: str, expected: str, value: Any) -> ConfigError:
  return ConfigError(f"config.{path}: expected {expected}, got {value!r}")


def _all_ranges() -> dict[str, Rule]:
  """Every one-key rule: the start-up dataclasses' tables under their keys
  (a length at 0 derived from the task, sampler.num_slots at 0 following
  sampler.batch_size), then `_RANGES`."""
  # pylint: disable=g-import-not-at-top
  from sao_jax.sampler import interface
  from sao_jax.sampler import precision
  from sao_jax.sampler import sampling
  from sao_jax.sandbox import limits
  from sao_jax.sandbox import pool
  from sao_jax.sandbox import probe
  from sao_jax.train import optim
  # pylint: enable=g-import-not-at-top
  code_limits = ("wall_s", "memory_mb", "total_memory_mb", "processes")
  return {
      **{f"model.{k}": r for k, r in model_config.FIELD_RULES.items()},
      "model.vocab_size": _DERIVABLE,
      **{f"sampler.{k}": r for k, r in sampling.FIELD_RULES.items()},
      **{f"sampler.{k}": r for k, r in interface.FIELD_RULES.items()},
      **{f"sampler.{k}": r for k, r in precision.FIELD_RULES.items()},
      "sampler.num_slots": Rule(lambda v: v >= 0,
                                "int >= 0 (0: sampler.batch_size)"),
      **{f"env.code_{k}": limits.FIELD_RULES[k] for k in code_limits},
      "env.code_sandbox": _in(probe.MECHANISMS),
      "env.code_mode": _in(pool.MODES),
      "optim.schedule": _in(optim.SCHEDULES),
      **_RANGES,
  }


def _check(config: Any, path: str, pred: Callable[[Any], bool],
           expected: str) -> None:
  value = get_path(config, path)[1]
  if not pred(value):
    raise _fail(path, expected, value)


def _check_rule(config: Any, path: str, rule: Rule) -> None:
  _check(config, path, rule.ok, rule.expected)


def _check_dataset_name(path: str, name: str) -> None:
  """`name` must be a reasoning_gym dataset or 'codeio' (suggesting the
  closest)."""
  # pylint: disable-next=g-import-not-at-top
  from sao_jax.envs import function_tasks

  known = reasoning_gym_import.dataset_subpackages()  # Not importing it.
  if name != function_tasks.NAME and name not in known:
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"config.{path}: expected a reasoning_gym dataset name or "
        f"{function_tasks.NAME!r}, got "
        f"{name!r}{hint}")


def _check_names(c: Any) -> None:
  """Names that must be registered: loss, estimator, env, datasets, answer
  rule, styles."""
  # pylint: disable=g-import-not-at-top
  from sao_jax.envs import answers
  from sao_jax.envs import evolving
  from sao_jax.envs import function_tasks
  from sao_jax.grading import humaneval
  from sao_jax.envs import reasoning_gym_env
  from sao_jax.envs import registry as envs
  from sao_jax.rl import advantages
  from sao_jax.rl import registry as losses
  # pylint: enable=g-import-not-at-top
  _check_rule(c, "rl.loss", _in(losses.known_losses(), "a registered loss"))
  known = advantages.available_advantages()
  _check(c, "rl.advantage", lambda v: v is None or v in known,
         f"one of {known} or None (the loss's own)")
  _check_rule(c, "env.name", _in(envs.available_envs(), "a registered env"))
  _check_dataset_name("env.dataset", c.env.dataset)
  _check_rule(c, "env.reward", _in(reasoning_gym_env.REWARD_RULES))
  _check_rule(c, "env.eval_dataset", _in(("", humaneval.NAME)))
  code = (c.env.dataset == function_tasks.NAME
          or c.env.eval_dataset == humaneval.NAME)
  _check(c, "env.answer", lambda v: v in answers.ANSWER_RULES and (
      v == "whole" or (c.env.name == "evolving"
                       and v in evolving.EVOLVING_ANSWER_RULES)
      or (c.env.name != "evolving" and not code)),
         f"one of {answers.ANSWER_RULES} ({evolving.EVOLVING_ANSWER_RULES} "
         "for the evolving env, 'whole' for code answers: codeio, "
         "humaneval)")
  _check(c, "env.styles",
         lambda v: bool(v) and all(s in evolving.STYLES for s in v),
         f"at least one style, each one of {evolving.STYLES}")
  _check(c, "env.style_change_steps",
         lambda v: all(s >= 0 for s in v) and list(v) == sorted(v),
         "non-decreasing steps >= 0")


def _check_tokenizer(c: Any) -> None:
  from sao_jax.tokenization import tokenizer  # pylint: disable=g-import-not-at-top

  t = c.tokenizer
  if t.path:
    return  # A given model file defines the vocabulary.
  _check(c, "tokenizer.vocab_size",
         lambda v: v == 0 or v >= tokenizer.MIN_VOCAB_SIZE,
         f"int >= {tokenizer.MIN_VOCAB_SIZE} (256 byte pieces + control and "
         "special tokens), or 0 for the size the corpus supports")
  _check_rule(c, "tokenizer.corpus_size", _POS)
  for i, name in enumerate(t.datasets):  # () = the run's env.dataset.
    _check_dataset_name(f"tokenizer.datasets[{i}]", name)
  if 0 < c.model.vocab_size < t.vocab_size:
    raise ConfigError(
        f"config.model.vocab_size: expected >= tokenizer.vocab_size="
        f"{t.vocab_size}, got {c.model.vocab_size}")


def _check_free_form_model_and_template(c: Any) -> None:
  """model.rope_scaling (layers/rope.py) and env.chat_template_kwargs."""
  import json  # pylint: disable=g-import-not-at-top
  from sao_jax.models.layers import rope  # pylint: disable=g-import-not-at-top

  try:
    scaling = dict(rope.normalize_scaling(dict(c.model.rope_scaling)))
  except ValueError as e:
    raise ConfigError(f"config.model.rope_scaling: {e}") from None
  longest = max(int(c.sampler.max_total_tokens), int(c.train.max_seq_len))
  if (scaling.get("rope_type") == "dynamic"
      and longest > scaling["max_position_embeddings"]):
    raise ConfigError(
        "config.model.rope_scaling: dynamic NTK RoPE rescales past "
        f"max_position_embeddings={scaling['max_position_embeddings']}, so "
        "the sampler's incremental log-probs would differ from the trainer's "
        "full forward; keep sampler.max_total_tokens and train.max_seq_len "
        f"<= it (got {longest}) or use rope_type 'yarn' or 'linear'")
  if (scaling.get("rope_type") == "longrope"
      and longest > scaling["original_max_position_embeddings"]):
    original = scaling["original_max_position_embeddings"]
    raise ConfigError(
        "config.model.rope_scaling: longrope switches from its short to its "
        f"long factors past original_max_position_embeddings={original}, so "
        "the sampler's incremental log-probs would differ from the trainer's "
        "full forward; keep sampler.max_total_tokens and train.max_seq_len "
        f"<= it (got {longest})")
  try:
    json.dumps(c.env.chat_template_kwargs.to_dict()
               if hasattr(c.env.chat_template_kwargs, "to_dict")
               else dict(c.env.chat_template_kwargs))
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.env.chat_template_kwargs: expected JSON "
                      f"values (template variables), got {e}") from None


def _check_sampler_devices(c: Any) -> None:
  from sao_jax.sampler import process  # pylint: disable=g-import-not-at-top

  try:
    process.parse_cores(str(c.sampler.devices))
  except ValueError:
    raise _fail("sampler.devices", "CPU core ids such as '0', '0,2' or "
                "'0-3' ('' for the JAX default)", c.sampler.devices) from None
  from sao_jax.sampler import devices  # pylint: disable=g-import-not-at-top

  try:  # A TPU split must leave both processes a valid sub-topology.
    devices.parse_chips(str(c.sampler.chips))
  except devices.ChipsError as e:
    raise ConfigError(f"config.{e}") from None
  from sao_jax.sampler import factory  # pylint: disable=g-import-not-at-top

  try:  # The rollout engine, and what it cannot report exactly.
    factory.check_config(c)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def _check_cross_fields(c: Any) -> None:
  """Keys that must agree with each other."""
  m, s, t = c.model, c.sampler, c.train
  if str(c.env.name) == "code":  # Only the code tool runs the sandbox.
    _check(c, "env.code_wall_s", lambda v: v + 3.0 < c.env.step_timeout_s,
           f"a float < env.step_timeout_s - 3 = {c.env.step_timeout_s - 3:g} "
           "(a call's bound plus the sandbox's clean-up grace)")
  _check(c, "model.routing_replay",
         lambda v: v != "rollout" or int(m.moe.num_experts) > 0,
         "'off' for a dense model ('rollout' replays the experts a "
         "mixture-of-experts policy routed to: set model.moe.num_experts > 0 "
         "or model.routing_replay='off')")
  # A length at 0 is derived later (sao_jax.envs.task_sizing), consistently.
  _check(c, "sampler.max_total_tokens",
         lambda v: not (v and s.max_new_tokens) or v >= s.max_new_tokens,
         f"int >= sampler.max_new_tokens={s.max_new_tokens}")
  _check(c, "train.publish_lag", lambda v: v <= t.max_staleness,
         f"int <= train.max_staleness={t.max_staleness} (trajectories "
         "sampled with held-back weights are at least that stale)")
  _check(c, "train.publish_lag",
         lambda v: v == 0 or t.mode in ("async", "replay"),
         f"0 in train.mode={t.mode!r} (the holdback needs 'async')")
  _check(c, "train.replay_steps",
         lambda v: not v or (len(v) == 2 and 0 <= v[0] < v[1]),
         "() (the whole recording) or (a, b) with 0 <= a < b")
  _check(c, "train.replay_from", lambda v: bool(v) or t.mode != "replay",
         "the recorded run's workdir with train.mode='replay'")
  _check(c, "train.max_seq_len",
         lambda v: not (v and s.max_total_tokens) or v >= s.max_total_tokens,
         f"int >= sampler.max_total_tokens={s.max_total_tokens}")
  _check_packing(c)
  if t.mode == "group" and s.n_rollouts < 2:
    raise ConfigError(
        f"config.sampler.n_rollouts: expected >= 2 for train.mode='group', "
        f"got {s.n_rollouts}")
  if t.batch_size % s.n_rollouts:
    raise ConfigError(
        f"config.train.batch_size: expected a multiple of sampler.n_rollouts="
        f"{s.n_rollouts} (whole groups), got {t.batch_size}")
  d = c.distributed
  if d.process_id is not None and d.num_processes is not None:
    _check(c, "distributed.process_id", lambda v: 0 <= v < d.num_processes,
           f"int in [0, distributed.num_processes={d.num_processes})")


def _check_packing(c: Any) -> None:
  """``train.pack`` needs the async stream and a per-token loss."""
  if not c.train.pack:
    return
  _check(c, "train.mode", lambda v: v == "async",
         "'async' with train.pack (sync/group alternate whole sampler "
         "batches and a replay re-reads per-step counts; set train.pack="
         "False)")
  _check(c, "train.record_stream", lambda v: not v,
         "False with train.pack (a replay of packed steps is not "
         "supported; set train.pack=False to record)")
  from sao_jax.data import packing  # pylint: disable=g-import-not-at-top
  _check(c, "rl.loss", lambda v: v not in packing.PER_ROW_LOSSES,
         "a loss that averages over tokens with train.pack (these reduce "
         f"per row: {', '.join(packing.PER_ROW_LOSSES)}; set "
         "train.pack=False)")


def _check_model(c: Any) -> None:
  """config.model as the start-up builds it: ``ModelConfig``'s rules across
  its fields (the experts, MLA, layer kinds)."""
  vocab = int(c.model.vocab_size) or 1  # 0: the task's, any size here.
  try:
    model_config.ModelConfig.from_config(c.model, vocab_size=vocab)
  except ranges.RangeError as e:
    raise _fail(f"model.{e.field}", e.expected, e.value) from None
  except ValueError as e:
    raise ConfigError(f"config.model: {e}") from None


def _check_mesh(c: Any) -> None:
  from sao_jax import sharding  # pylint: disable=g-import-not-at-top

  try:
    sharding.check_mesh_sizes([c.mesh[a] for a in sharding.MESH_AXES])
  except sharding.MeshError as e:
    raise _fail(e.key, e.expected, e.value) from None
  try:
    sharding.normalize_rules(c.mesh.rules)
  except sharding.MeshError as e:
    raise ConfigError(f"config.mesh.rules: {e}") from None
  if c.mesh.data > 0 and c.mesh.fsdp > 0:
    _check_batch_divisible(c, c.mesh.data * c.mesh.fsdp)
  from sao_jax.sampler import mesh as sampler_mesh  # pylint: disable=g-import-not-at-top

  sizes = [c.sampler.mesh[a] for a in sampler_mesh.FIELDS]
  try:  # As the sampler resolves them (tensor 0: auto).
    sharding.check_mesh_sizes(sampler_mesh.mesh_sizes(c))
  except sharding.MeshError:
    raise _fail("sampler.mesh", "data, expert, tensor sizes positive or "
                "-1 (fill), at most one -1; tensor 0: auto", dict(zip(
                    sampler_mesh.FIELDS, sizes))) from None


def _check_batch_divisible(c: Any, shards: int) -> None:
  if c.train.batch_size % shards:
    raise ConfigError(
        f"config.train.batch_size: expected a multiple of mesh data*fsdp="
        f"{shards}, got {c.train.batch_size}")


def validate_config(config: Any,
                    base: ml_collections.ConfigDict | None = None) -> None:
  """Raises `ConfigError` (one line, naming the key) if `config` is invalid.

  Args:
    config: the experiment config (ConfigDict / FrozenConfigDict).
    base: the reference config; default `configs/base.py`.
  """
  base = base_config() if base is None else base
  check_key_tree(config, base)
  for path, rule in _all_ranges().items():
    _check_rule(config, path, rule)
  for check in (_check_names, _check_tokenizer, _check_sampler_devices,
                _check_cross_fields, _check_mesh,
                _check_free_form_model_and_template, _check_model):
    check(config)


def validate_mesh(config: Any, num_devices: int) -> tuple[int, ...]:
  """Resolves the mesh for `num_devices`; checks the batch divides over it."""
  from sao_jax import sharding  # pylint: disable=g-import-not-at-top

  try:
    shape = sharding.resolve_mesh_shape(
        [config.mesh[a] for a in sharding.MESH_AXES], num_devices)
  except sharding.MeshError as e:
    raise ConfigError(f"config.mesh: {e}") from None
  _check_batch_divisible(config, shape[0] * shape[1])
  return shape
