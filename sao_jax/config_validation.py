"""Checks an experiment config before any compute starts.

The reference is `configs/base.py`: a config may only hold keys that exist
there (the free-form sections in `FREE_FORM` excepted), of the same types, with
values in range and consistent with each other. Every failure raises
`ConfigError` whose message is one line naming the key, e.g.

  config.rl.eps_low: expected float in (0, 1), got 1.5
"""

from __future__ import annotations

import difflib
import importlib.util
import math
import os
import pathlib
from typing import Any, Callable, Iterator

import ml_collections

from sao_jax.models.config import ATTENTION_IMPLEMENTATIONS
from sao_jax.models.config import MLP_ACTIVATIONS
from sao_jax.models.config import NORM_STYLES
from sao_jax.models.config import REMAT_POLICIES

# Sections whose keys are passed through unchecked (e.g. kwargs of
# reasoning_gym.create_dataset).
FREE_FORM = ("env.dataset_config", "env.chat_template_kwargs",
             "model.rope_scaling")
TRAIN_MODES = ("async", "sync", "group", "replay")
# model.routing_replay: R3 (the sampler's recorded experts) or the trainer's
# own routing (docs/design/models.md "Routing replay (R3): what the sampler
# records").
ROUTING_REPLAY = ("off", "rollout")
SCHEDULES = ("constant", "cosine")
DTYPES = ("float32", "bfloat16", "float16")

_BASE_CONFIG = (pathlib.Path(__file__).resolve().parents[1] / "configs" /
                "base.py")


class ConfigError(ValueError):
  """A config key is unknown, mistyped, out of range or inconsistent."""


def base_config(path: str | os.PathLike[str] | None = None
                ) -> ml_collections.ConfigDict:
  """Loads `get_config()` of `configs/base.py` (the reference key tree)."""
  path = pathlib.Path(path or _BASE_CONFIG)
  if not path.is_file():
    raise FileNotFoundError(
        f"base config {path} not found; run from a sao_jax checkout or pass "
        "its path.")
  spec = importlib.util.spec_from_file_location("sao_jax_base_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def _leaf_paths(cfg: Any, prefix: str = "") -> Iterator[str]:
  for key, value in cfg.items():
    path = f"{prefix}{key}"
    if isinstance(value, (ml_collections.ConfigDict, dict)):
      yield from _leaf_paths(value, path + ".")
    else:
      yield path


def _unknown_key_error(path: str, siblings: list[str],
                       base: Any) -> ConfigError:
  parent, _, key = path.rpartition(".")
  close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
  if close:
    hint = f"; did you mean config.{parent + '.' if parent else ''}{close[0]}?"
  else:
    elsewhere = [p for p in _leaf_paths(base) if p.rpartition(".")[2] == key]
    if elsewhere:
      hint = f"; did you mean config.{elsewhere[0]}?"
    else:
      known = ", ".join(sorted(siblings))
      hint = f"; known keys here: {known}"
  return ConfigError(f"config.{path}: unknown key{hint}")


def check_key_path(path: str, base: ml_collections.ConfigDict | None = None
                   ) -> None:
  """Raises ConfigError if the dotted `path` (e.g. 'rl.eps_low') is unknown."""
  base = base_config() if base is None else base
  node, done = base, []
  for part in path.split("."):
    if ".".join(done) in FREE_FORM:
      return
    if not isinstance(node, (ml_collections.ConfigDict, dict)):
      raise ConfigError(
          f"config.{'.'.join(done)}: is a {type(node).__name__} value, it has "
          f"no key {part!r}")
    if part not in node:
      raise _unknown_key_error(".".join(done + [part]), list(node.keys()), base)
    node = node[part]
    done.append(part)


def get_path(config: Any, path: str) -> tuple[bool, Any]:
  """(True, value) at the dotted `path` of `config`, or (False, None)."""
  node = config
  for part in path.split("."):
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or (
        part not in node):
      return False, None
    node = node[part]
  return True, node


def _type_name(t: type) -> str:
  return {ml_collections.ConfigDict: "config section"}.get(t, t.__name__)


def _check_type(path: str, value: Any, base_parent: Any, key: str) -> None:
  """`value` must have the type of the base field (int allowed for float)."""
  ref = base_parent.get_ref(key) if hasattr(base_parent, "get_ref") else None
  want = ref.get_type() if ref is not None else type(base_parent[key])
  base_value = base_parent[key]
  if value is None:
    if base_value is None:
      return  # Optional (placeholder) field.
    raise ConfigError(f"config.{path}: expected {_type_name(want)}, got None")
  ok = {
      float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
      int: lambda v: isinstance(v, int) and not isinstance(v, bool),
      tuple: lambda v: isinstance(v, (tuple, list)),
      list: lambda v: isinstance(v, (tuple, list)),
  }.get(want, lambda v: isinstance(v, want))
  if not ok(value):
    raise ConfigError(
        f"config.{path}: expected {_type_name(want)}, got "
        f"{type(value).__name__} {value!r}")
  # Homogeneous tuples of scalars (dataset names, step lists) keep their
  # element type.
  if want is tuple and base_value:
    elem = {type(x) for x in base_value}
    if len(elem) == 1 and next(iter(elem)) in (int, float, str):
      (etype,) = elem
      for i, x in enumerate(value):
        if not isinstance(x, etype) or isinstance(x, bool):
          raise ConfigError(
              f"config.{path}[{i}]: expected {etype.__name__}, got "
              f"{type(x).__name__} {x!r}")


def check_keys_and_types(config: Any, base: Any, prefix: str = "",
                         root: Any = None) -> None:
  """Every key of `config` exists in `base` with a compatible type.

  Args:
    config: (a section of) the config to check.
    base: the matching section of the reference config.
    prefix: dotted path of the section, '' at the top.
    root: the whole reference config (for suggestions across sections).
  """
  root = base if root is None else root
  for key, value in config.items():
    path = f"{prefix}{key}"
    if key not in base:
      raise _unknown_key_error(path, list(base.keys()), root)
    base_value = base[key]
    if isinstance(base_value, ml_collections.ConfigDict):
      if not isinstance(value, (ml_collections.ConfigDict, dict)):
        raise ConfigError(
            f"config.{path}: expected a config section, got "
            f"{type(value).__name__} {value!r}")
      if path not in FREE_FORM:
        check_keys_and_types(value, base_value, path + ".", root)
    else:
      _check_type(path, value, base, key)


# ------------------------------------------------------------ value checks ---


def _fail(path: str, expected: str, value: Any) -> ConfigError:
  return ConfigError(f"config.{path}: expected {expected}, got {value!r}")


def _pos_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _nonneg(v) -> bool:
  return v >= 0


def _in(names: tuple[str, ...], what: str = "one of"):
  return (lambda v: v in names), f"{what} {names}"


_POS = (_pos_int, "a positive int")
# Settings that may follow the task (0 = derive; sao_jax.envs.task_sizing).
_DERIVABLE = ((lambda v: isinstance(v, int) and v >= 0),
              "a positive int, or 0 to derive it from the task")
_NONNEG = (_nonneg, "int >= 0")
_GT0 = ((lambda v: v > 0), "float > 0")
_FINITE_GT0 = ((lambda v: 0 < v < math.inf), "a finite float > 0")
_UNIT = ((lambda v: 0 <= v <= 1), "float in [0, 1]")
_BETA = ((lambda v: 0 <= v < 1), "float in [0, 1)")

# One-field checks: dotted key -> (predicate, what was expected).
_RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "model.vocab_size": _DERIVABLE,
    **{f"model.{k}": _POS for k in (
        "hidden_size", "intermediate_size", "num_layers",
        "num_heads", "num_kv_heads", "head_dim")},
    "model.rope_theta": _GT0, "model.rms_norm_eps": _GT0,
    "model.dtype": _in(DTYPES), "model.param_dtype": _in(DTYPES),
    "model.logits_chunk": (
        (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
        "an int >= 0 (tokens per chunk of the log-probs; 0: full logits)"),
    "model.attention": _in(ATTENTION_IMPLEMENTATIONS),
    "model.attention_block_q": _POS, "model.attention_block_kv": _POS,
    "model.remat_policy": _in(REMAT_POLICIES),
    "model.scan_layers": ((lambda v: isinstance(v, bool)), "True or False"),
    "model.sliding_window": (
        _nonneg, "an int >= 0 (attention window in tokens; 0: none)"),
    "model.norm_style": _in(NORM_STYLES),
    "model.mlp_activation": _in(MLP_ACTIVATIONS),
    "model.local_rope_theta": ((lambda v: v >= 0), "float >= 0 (0: rope_theta)"),
    "model.query_pre_attn_scalar": (
        (lambda v: v >= 0), "float >= 0 (0: head_dim)"),
    "model.routing_replay": _in(ROUTING_REPLAY),
    "env.size": _POS, "env.eval_size": _POS, "env.max_turns": _POS,
    "env.max_tool_calls": _NONNEG, "env.step_timeout_s": _FINITE_GT0,
    "env.code_sandbox": _in(("auto", "bwrap", "landlock",
                             "unsafe_subprocess")),
    "env.code_mode": _in(("warm", "strict")), "env.code_workers": _POS,
    "env.code_wall_s": _FINITE_GT0, "env.code_memory_mb": _POS,
    "env.code_total_memory_mb": _NONNEG, "env.code_processes": _POS,
    "env.code_observation_chars": ((lambda v: isinstance(v, int) and v >= 64),
                                   "an int >= 64"),
    "sampler.temperature": _GT0,
    "sampler.top_p": ((lambda v: 0 < v <= 1), "float in (0, 1]"),
    "sampler.top_k": (_nonneg, "int >= 0 (0 disables top-k)"),
    "sampler.max_new_tokens": _DERIVABLE,
    "sampler.max_total_tokens": _DERIVABLE,
    "sampler.min_prompt_bucket": _POS,
    "sampler.batch_size": _POS, "sampler.n_rollouts": _POS,
    "sampler.num_slots": _NONNEG, "sampler.decode_chunk": _POS,
    "sampler.weight_poll_tokens": _NONNEG, "sampler.env_threads": _POS,
    "sampler.kv_on_swap": _in(("keep", "recompute")),
    "sampler.max_restarts": _NONNEG, "sampler.restart_window_s": _GT0,
    "sampler.max_restarts_per_window": _NONNEG,
    "env.longtail_min_tokens": _POS, "env.longtail_levels": _POS,
    "env.longtail_tool_calls": _NONNEG, "env.longtail_tool_latency_s": (
        (lambda v: 0 <= v < math.inf), "a finite float >= 0"),
    "rl.eps_low": ((lambda v: v is None or 0 < v <= 1),
                   "None (the loss's default) or a float in (0, 1]"),
    "rl.eps_high": ((lambda v: v is None or v > 0),
                    "None (the loss's default) or a float > 0"),
    "rl.kl_coef": (_nonneg, "float >= 0"),
    "rl.gamma": _UNIT, "rl.lam_critic": _UNIT, "rl.lam_policy_alpha": _GT0,
    "rl.running_mean_k": _POS,
    "rl.running_mean_scope": ((lambda v: v in ("prompt", "global")),
                              "'prompt' or 'global'"),
    "rl.critic_warmup_steps": _NONNEG, "rl.critic_updates_per_step": _POS,
    "rl.value_clip": ((lambda v: v is None or v > 0), "None or float > 0"),
    "optim.actor_lr": _FINITE_GT0, "optim.critic_lr": _FINITE_GT0,
    "optim.grad_clip": ((lambda v: v == 0 or 0 < v < math.inf),
                        "a finite float > 0 (global-norm clip) or 0 (no "
                        "clipping)"),
    "optim.warmup_steps": _NONNEG, "optim.schedule": _in(SCHEDULES),
    "optim.weight_decay": (_nonneg, "float >= 0"), "optim.b1": _BETA,
    "optim.b2": _BETA, "optim.eps": _GT0,
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
    "train.sft_lr": _FINITE_GT0, "train.max_error_frac": _UNIT, "train.sft_tool_frac": _UNIT,
    "ring.capacity_bytes": _POS, "ring.put_timeout_s": _GT0,
    "ring.get_timeout_s": _GT0,
    "distributed.num_processes": ((lambda v: v is None or v >= 1),
                                  "None or int >= 1"),
}


def _check(config: Any, path: str, pred: Callable[[Any], bool],
           expected: str) -> None:
  value = get_path(config, path)[1]
  if not pred(value):
    raise _fail(path, expected, value)


def _check_dataset_name(path: str, name: str) -> None:
  """`name` must be a reasoning_gym dataset or 'codeio' (suggesting the
  closest)."""
  from reasoning_gym import factory  # pylint: disable=g-import-not-at-top
  from sao_jax.envs import function_tasks  # pylint: disable=g-import-not-at-top

  if name != function_tasks.NAME and name not in factory.DATASETS:
    close = difflib.get_close_matches(name, list(factory.DATASETS), n=1)
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
  _check(c, "rl.loss", *_in(losses.known_losses(), "a registered loss"))
  _check(c, "rl.advantage", lambda v: v is None or v in advantages.ESTIMATORS,
         f"one of {advantages.ESTIMATORS} or None (the loss's own)")
  _check(c, "env.name", *_in(envs.available_envs(), "a registered env"))
  _check_dataset_name("env.dataset", c.env.dataset)
  _check(c, "env.reward", *_in(reasoning_gym_env.REWARD_RULES))
  _check(c, "env.eval_dataset", *_in(("", humaneval.NAME)))
  code = (c.env.dataset == function_tasks.NAME
          or c.env.eval_dataset == humaneval.NAME)
  _check(c, "env.answer", lambda v: v in answers.ANSWER_RULES and (
      v == "whole" or (c.env.name != "evolving" and not code)),
         f"one of {answers.ANSWER_RULES} ('whole' for the evolving env and "
         "for code answers: codeio, humaneval)")
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
  _check(c, "tokenizer.corpus_size", *_POS)
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
  if m.num_heads % m.num_kv_heads:
    raise ConfigError(
        f"config.model.num_heads: expected a multiple of model.num_kv_heads="
        f"{m.num_kv_heads} (grouped-query attention), got {m.num_heads}")
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
  check_keys_and_types(config, base)
  missing = [p for p in _leaf_paths(base) if not get_path(config, p)[0]
             and not any(p.startswith(f + ".") for f in FREE_FORM)]
  if missing:
    raise ConfigError(
        f"config.{missing[0]}: missing (start the config from configs/base.py"
        f" get_config())")
  for path, (pred, expected) in _RANGES.items():
    _check(config, path, pred, expected)
  for check in (_check_names, _check_tokenizer, _check_sampler_devices,
                _check_cross_fields, _check_mesh,
                _check_free_form_model_and_template):
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
