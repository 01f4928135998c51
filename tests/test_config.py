"""Tests for configs/base.py, sao_jax.config_validation and sao_jax.main."""

import os
import pathlib
import subprocess
import sys

import ml_collections
import pytest

from sao_jax import config_validation as cv
from sao_jax.rl import registry
from sao_jax.tokenization import tokenizer

_REPO = pathlib.Path(__file__).resolve().parents[1]
_BASE = str(_REPO / "configs" / "base.py")


@pytest.fixture
def config():
  return cv.base_config()


def _error(config) -> str:
  with pytest.raises(cv.ConfigError) as info:
    cv.validate_config(config)
  msg = str(info.value)
  assert "\n" not in msg, msg
  return msg


def test_base_config_validates(config):
  cv.validate_config(config)
  cv.validate_config(ml_collections.FrozenConfigDict(config))
  # The defaults the paper gives.
  # eps_low/eps_high None: each loss's registered band (SAO's DIS: 0.3 / 5.0).
  assert (config.rl.loss, config.rl.eps_low, config.rl.eps_high) == (
      "sao", None, None)
  assert registry.resolve_hparams("sao", config.rl) == {
      "eps_low": 0.3, "eps_high": 5.0}
  assert registry.resolve_hparams("grpo", config.rl) == {
      "eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.0}
  assert config.rl.critic_warmup_steps == 10
  assert config.rl.critic_updates_per_step == 2
  assert (config.optim.actor_lr, config.optim.critic_lr) == (1e-6, 5e-6)
  assert config.sampler.n_rollouts == 1
  assert config.tokenizer.vocab_size >= tokenizer.MIN_VOCAB_SIZE


def test_base_config_documents_every_default():
  """Each `config.a.b = ...` has a trailing comment or heads from a comment.

  An assignment without its own comment is documented by the nearest
  full-line comment above it, through uncommented assignments only.
  """
  lines = [l.strip() for l in pathlib.Path(_BASE).read_text().splitlines()]
  undocumented = []
  for i, line in enumerate(lines):
    if not line.startswith("config.") or "ConfigDict()" in line:
      continue
    j = i
    while "#" not in lines[j] and j > 0 and (
        lines[j - 1].startswith("config.") or lines[j - 1].startswith("#")):
      j -= 1
      if lines[j].startswith("#"):
        break
      if "#" in lines[j]:  # A sibling's own comment: not ours.
        j = -1
        break
    if j < 0 or "#" not in lines[j]:
      undocumented.append(line)
  assert not undocumented, undocumented


def test_typo_names_key_and_suggests(config):
  config.rl.eps_lwo = 0.2
  assert _error(config) == (
      "config.rl.eps_lwo: unknown key; did you mean config.rl.eps_low?")


def test_key_in_wrong_section_suggests_right_one(config):
  config.train.critic_lr = 1e-5
  assert _error(config) == (
      "config.train.critic_lr: unknown key; did you mean "
      "config.optim.critic_lr?")


def test_unknown_section_lists_known_keys(config):
  config.zzz = 1
  msg = _error(config)
  assert msg.startswith("config.zzz: unknown key; known keys here: ")
  assert "rl" in msg and "model" in msg


def test_free_form_section_is_not_checked(config):
  config.env.dataset_config.min_terms = 2
  config.env.dataset_config.max_terms = 4
  cv.validate_config(config)


@pytest.mark.parametrize("path,value,expected", [
    ("rl.eps_low", "0.2", "config.rl.eps_low: expected float, got str '0.2'"),
    ("model.num_layers", 2.5,
     "config.model.num_layers: expected int, got float 2.5"),
    ("model.num_layers", True,
     "config.model.num_layers: expected int, got bool True"),
    ("rl.critic_frozen_attention", 1,
     "config.rl.critic_frozen_attention: expected bool, got int 1"),
    ("optim.actor_lr", None, "config.optim.actor_lr: expected float, got None"),
    ("rl.value_clip", "big",
     "config.rl.value_clip: expected float, got str 'big'"),
    ("tokenizer.datasets", ("chain_sum", 3),
     "config.tokenizer.datasets[1]: expected str, got int 3"),
    ("model", 3, "config.model: expected a config section, got int 3"),
])
def test_wrong_type(path, value, expected):
  # A plain dict: ConfigDict itself refuses most type changes on assignment.
  raw = cv.base_config().to_dict()
  section, _, key = path.rpartition(".")
  (raw[section] if section else raw)[key] = value
  assert _error(ml_collections.ConfigDict(raw, type_safe=False)) == expected


def test_int_for_float_and_placeholder_are_accepted(config):
  config.rl.eps_high = 3  # int where float is expected.
  config.rl.value_clip = 0.2  # Optional (placeholder) field set.
  config.distributed.num_processes = 2
  config.distributed.process_id = 1
  cv.validate_config(config)


@pytest.mark.parametrize("updates,expected", [
    ({"rl.eps_low": 1.5},
     "config.rl.eps_low: expected None (the loss's default) or a float in "
     "(0, 1], got 1.5"),
    ({"rl.eps_low": 0.0},
     "config.rl.eps_low: expected None (the loss's default) or a float in "
     "(0, 1], got 0.0"),
    ({"rl.eps_high": -1.0}, "config.rl.eps_high: expected None (the loss's "
     "default) or a float > 0, got -1.0"),
    ({"env.styles": ("plain", "tagged")}, "config.env.styles: expected at "
     "least one style, each one of ('boxed', 'answer_tag', 'plain'), got "
     "('plain', 'tagged')"),
    ({"train.publish_lag": 5}, "config.train.publish_lag: expected int <= "
     "train.max_staleness=4"),
    ({"train.publish_lag": 2, "train.mode": "sync"},
     "config.train.publish_lag: expected 0 in train.mode='sync'"),
    ({"rl.loss": "sa0"}, "config.rl.loss: expected a registered loss"),
    ({"rl.advantage": "gea"}, "config.rl.advantage: expected one of"),
    ({"env.name": "gym"}, "config.env.name: expected a registered env "
     "('code', 'evolving', 'reasoning_gym', 'repair', 'tool', 'tool_longtail'), got 'gym'"),
    ({"env.dataset": "chainsum"}, "config.env.dataset: expected a "
     "reasoning_gym dataset name or 'codeio', got 'chainsum' (did you mean "
     "'chain_sum'?)"),
    ({"tokenizer.datasets": ("chain_sum", "leg_count")},
     "config.tokenizer.datasets[1]: expected a reasoning_gym dataset name or "
     "'codeio', got 'leg_count' (did you mean 'leg_counting'?)"),
    ({"env.dataset": "codeio", "env.answer": "last_number"},
     "config.env.answer: expected one of"),
    ({"env.name": "evolving", "env.answer": "answer_tag"},
     "config.env.answer: expected one of ('whole', 'last_number', "
     "'answer_tag', 'answer_tag_or_last_number') (('whole', 'last_number') "
     "for the evolving env"),
    ({"env.eval_dataset": "mbpp"}, "config.env.eval_dataset: expected one of "
     "('', 'humaneval'), got 'mbpp'"),
    ({"train.mode": "asynch"},
     "config.train.mode: expected one of ('async', 'sync', 'group', "
     "'replay'), got 'asynch'"),
    ({"train.mode": "replay"}, "config.train.replay_from: expected the "
     "recorded run's workdir with train.mode='replay', got ''"),
    ({"train.replay_steps": (5, 2)}, "config.train.replay_steps: expected () "
     "(the whole recording) or (a, b) with 0 <= a < b, got (5, 2)"),
    ({"train.record_shard_steps": 0}, "config.train.record_shard_steps: "
     "expected a positive int, got 0"),
    ({"train.pack_max_segments": 0}, "config.train.pack_max_segments: "
     "expected a positive int, got 0"),
    ({"train.pack": True, "train.mode": "sync"}, "config.train.mode: "
     "expected 'async' with train.pack"),
    ({"train.pack": True, "train.record_stream": True},
     "config.train.record_stream: expected False with train.pack"),
    ({"train.pack": True, "rl.loss": "grpo"}, "config.rl.loss: expected a "
     "loss that averages over tokens with train.pack"),
    ({"model.num_heads": 6, "model.num_kv_heads": 4},
     "config.model.num_heads: expected a multiple of num_kv_heads=4 "
     "(grouped-query attention), got 6"),
    ({"model.routing_replay": "on"}, "config.model.routing_replay: expected "
     "one of ('off', 'rollout'), got 'on'"),
    ({"model.routing_replay": "rollout"}, "config.model.routing_replay: "
     "expected 'off' for a dense model ('rollout' replays the experts"),
    ({"model.hidden_size": 0},
     "config.model.hidden_size: expected a positive int, got 0"),
    ({"model.vocab_size": 300},
     "config.model.vocab_size: expected >= tokenizer.vocab_size=512, got 300"),
    ({"tokenizer.vocab_size": 200, "model.vocab_size": 512},
     "config.tokenizer.vocab_size: expected int >= 267"),
    ({"mesh.data": 2, "mesh.fsdp": 4, "train.batch_size": 12},
     "config.train.batch_size: expected a multiple of mesh data*fsdp=8, "
     "got 12"),
    ({"mesh.data": -1, "mesh.fsdp": -1},
     "config.mesh: expected at most one of data/fsdp/tensor = -1"),
    ({"mesh.tensor": 0},
     "config.mesh.tensor: expected a positive int or -1 (fill), got 0"),
    ({"mesh.rules": (("mlp", "model"),)},
     "config.mesh.rules: sharding rule ('mlp', 'model') names mesh axes"),
    ({"sampler.top_p": 0.0},
     "config.sampler.top_p: expected float in (0, 1], got 0.0"),
    ({"sampler.max_new_tokens": 300},
     "config.sampler.max_total_tokens: expected int >= "
     "sampler.max_new_tokens=300, got 256"),
    ({"sampler.max_total_tokens": 512},
     "config.train.max_seq_len: expected int >= "
     "sampler.max_total_tokens=512, got 256"),
    ({"train.mode": "group"},
     "config.sampler.n_rollouts: expected >= 2 for train.mode='group', got 1"),
    ({"sampler.n_rollouts": 3},
     "config.train.batch_size: expected a multiple of sampler.n_rollouts=3 "
     "(whole groups), got 16"),
    ({"optim.schedule": "linear"},
     "config.optim.schedule: expected one of ('constant', 'cosine'), got "
     "'linear'"),
    ({"optim.b2": 1.0}, "config.optim.b2: expected float in [0, 1), got 1.0"),
    ({"env.style_change_steps": (200, 100)},
     "config.env.style_change_steps: expected non-decreasing steps >= 0"),
    ({"distributed.num_processes": 2, "distributed.process_id": 2},
     "config.distributed.process_id: expected int in [0, "
     "distributed.num_processes=2), got 2"),
])
def test_inconsistent_values(config, updates, expected):
  for path, value in updates.items():
    section, key = path.split(".")
    config[section][key] = value
  assert _error(config).startswith(expected)


def test_routing_replay_passes_with_experts(config):
  config.model.routing_replay = "rollout"
  config.model.moe.num_experts = 8
  config.model.moe.intermediate_size = 64
  cv.validate_config(config)


def test_rope_scaling_and_template_kwargs_are_checked(config):
  import ml_collections  # pylint: disable=g-import-not-at-top
  config.model.rope_scaling = ml_collections.ConfigDict(
      {"rope_type": "llama3", "factor": 8.0})
  assert _error(config).startswith(
      "config.model.rope_scaling: rope_type='llama3': unsupported keys [], "
      "missing keys ['high_freq_factor', 'low_freq_factor', "
      "'original_max_position_embeddings']")
  config.model.rope_scaling = ml_collections.ConfigDict(
      {"rope_type": "linear", "factor": 2.0})
  cv.validate_config(config)
  config.env.chat_template_kwargs = ml_collections.ConfigDict(
      {"enable_thinking": False})
  cv.validate_config(config)
  config.model.rope_scaling = ml_collections.ConfigDict(
      {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64})
  assert _error(config).startswith(
      "config.model.rope_scaling: dynamic NTK RoPE rescales past "
      "max_position_embeddings=64")
  config.model.rope_scaling.max_position_embeddings = 4096
  cv.validate_config(config)
  config.model.rope_scaling = ml_collections.ConfigDict(
      {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
       "original_max_position_embeddings": 64})
  assert _error(config).startswith(
      "config.model.rope_scaling: longrope switches from its short to its "
      "long factors past original_max_position_embeddings=64")
  config.model.rope_scaling.original_max_position_embeddings = 4096
  cv.validate_config(config)


def test_consistent_unusual_values_pass(config):
  config.model.num_heads = 6  # GQA groups of 3 over 2 kv heads.
  config.model.head_dim = 24  # head_dim * heads != hidden is allowed (Qwen).
  config.train.mode = "group"
  config.sampler.n_rollouts = 4
  config.mesh.data, config.mesh.fsdp = 2, 2
  cv.validate_config(config)


def test_experiment_configs_validate():
  """Every configs/*.py experiment passes validation."""
  import importlib.util
  paths = sorted((_REPO / "configs").glob("*.py"))
  checked = 0
  for path in paths:
    if path.name == "__init__.py":
      continue
    spec = importlib.util.spec_from_file_location(f"cfg_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(_REPO))
    try:
      spec.loader.exec_module(module)
    finally:
      sys.path.remove(str(_REPO))
    cv.validate_config(module.get_config())
    checked += 1
  assert checked >= 1


def test_validate_mesh_against_devices(config):
  assert cv.validate_mesh(config, 8) == (1, 8, 1)
  config.mesh.data, config.mesh.fsdp = 2, -1
  assert cv.validate_mesh(config, 8) == (2, 4, 1)
  config.train.batch_size = 12
  with pytest.raises(cv.ConfigError,
                     match=r"^config.train.batch_size: expected a multiple of "
                     r"mesh data\*fsdp=8, got 12$"):
    cv.validate_mesh(config, 8)
  config.mesh.data, config.mesh.fsdp = 3, 1
  with pytest.raises(cv.ConfigError, match="needs 3 devices but 8"):
    cv.validate_mesh(config, 8)


def test_check_key_path(config):
  cv.check_key_path("rl.eps_low", config)
  cv.check_key_path("env.dataset_config.anything", config)
  with pytest.raises(cv.ConfigError, match="did you mean config.rl.eps_low"):
    cv.check_key_path("rl.eps_lwo", config)
  with pytest.raises(cv.ConfigError, match="config.rl.gamma: is a float"):
    cv.check_key_path("rl.gamma.x", config)


def _run_main(*args, workdir):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run(
      [sys.executable, "-m", "sao_jax.main", f"--config={_BASE}",
       f"--workdir={workdir}", *args],
      capture_output=True, text=True, timeout=300, env=env, cwd=workdir)


def _last_line(stderr: str) -> str:
  return stderr.strip().splitlines()[-1]


@pytest.mark.multiprocess
def test_main_rejects_bad_overrides(tmp_path):
  typo = _run_main("--config.rl.eps_lwo=0.2", workdir=tmp_path)
  assert typo.returncode != 0
  assert typo.stderr.strip() == (
      "config.rl.eps_lwo: unknown key; did you mean config.rl.eps_low?")
  assert "Traceback" not in typo.stderr

  out_of_range = _run_main("--config.rl.eps_low=1.5", workdir=tmp_path)
  assert out_of_range.returncode != 0
  assert out_of_range.stderr.strip() == (
      "config.rl.eps_low: expected None (the loss's default) or a float in "
      "(0, 1], got 1.5")

  bad_type = _run_main("--config.model.num_layers=2.5", workdir=tmp_path)
  assert bad_type.returncode != 0
  assert _last_line(bad_type.stderr).startswith(
      "flag --config.model.num_layers=2.5: invalid literal for int()")


@pytest.fixture
def main_module(monkeypatch):
  """sao_jax.main with `parse(argv)`, which sets sys.argv as app.run does."""
  from absl import flags
  from sao_jax import main

  def parse(argv):
    monkeypatch.setattr(sys, "argv", list(argv))
    return main.parse_flags(argv)

  main.parse = parse
  yield main
  flags.FLAGS.unparse_flags()
  # config_flags defines one flag per override; drop them for the next parse.
  for name in list(flags.FLAGS):
    if name.startswith("config."):
      delattr(flags.FLAGS, name)
  del main.parse


def test_main_validates_then_calls_trainer(main_module, tmp_path, monkeypatch,
                                          capsys):
  calls = []
  fake_loop = type(sys)("sao_jax.train.loop")
  fake_loop.train_and_evaluate = lambda c, w: calls.append((c, w)) or {
      "accuracy_after": 0.625, "steps": 3}
  monkeypatch.setitem(sys.modules, "sao_jax.train.loop", fake_loop)
  main_module.parse([
      "main", f"--config={_BASE}", f"--workdir={tmp_path}",
      "--config.rl.eps_low=0.2", "--config.mesh.tensor=1",
      "--config.env.dataset_config.min_terms=3"])
  main_module.main(["main"])
  assert len(calls) == 1
  config, workdir = calls[0]
  assert workdir == str(tmp_path)
  assert config.rl.eps_low == 0.2 and config.mesh.tensor == 1
  assert config.rl.eps_high is None  # The loss's default.
  assert config.env.dataset_config.min_terms == 3  # Free-form key added.
  with pytest.raises(AttributeError):  # Locked after validation.
    config.rl.eps_lwo = 0.1
  out = capsys.readouterr().out  # The summary table the CLI prints.
  assert "accuracy_after" in out and "0.625" in out and "steps" in out


def test_main_stops_on_invalid_config_before_trainer(main_module, tmp_path,
                                                      monkeypatch):
  calls = []
  fake_loop = type(sys)("sao_jax.train.loop")
  fake_loop.train_and_evaluate = lambda c, w: calls.append((c, w))
  monkeypatch.setitem(sys.modules, "sao_jax.train.loop", fake_loop)
  main_module.parse([
      "main", f"--config={_BASE}", f"--workdir={tmp_path}",
      "--config.mesh.fsdp=3"])
  with pytest.raises(SystemExit) as info:
    main_module.main(["main"])
  assert str(info.value.code) == (
      "config.train.batch_size: expected a multiple of mesh data*fsdp=3, "
      "got 16")
  assert not calls


def test_main_checks_mesh_against_devices(main_module, tmp_path,
                                          monkeypatch):
  import jax
  calls = []
  fake_loop = type(sys)("sao_jax.train.loop")
  fake_loop.train_and_evaluate = lambda c, w: calls.append((c, w))
  monkeypatch.setitem(sys.modules, "sao_jax.train.loop", fake_loop)
  n = jax.device_count()
  main_module.parse([
      "main", f"--config={_BASE}", f"--workdir={tmp_path}",
      f"--config.mesh.data={n + 1}", "--config.mesh.fsdp=1",
      f"--config.train.batch_size={n + 1}"])
  with pytest.raises(SystemExit) as info:
    main_module.main(["main"])
  assert str(info.value.code) == (
      f"config.mesh: mesh data={n + 1}, fsdp=1, tensor=1 needs {n + 1} "
      f"devices but {n} are available; make the sizes multiply to the device "
      "count or set one to -1.")
  assert not calls


def test_main_without_trainer_exits_clearly(main_module, tmp_path,
                                            monkeypatch):
  monkeypatch.setitem(sys.modules, "sao_jax.train.loop", None)
  main_module.parse(["main", f"--config={_BASE}",
                           f"--workdir={tmp_path}"])
  with pytest.raises(SystemExit) as info:
    main_module.main(["main"])
  assert str(info.value.code).startswith(
      "The trainer is not available: sao_jax.train.loop")
