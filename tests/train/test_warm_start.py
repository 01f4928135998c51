"""The policy a run starts from: a checkpoint, then SFT when asked."""

import jax
import numpy as np
import pytest

from sao_jax.envs import build as env_build
from sao_jax.envs import task_sizing
from sao_jax.models import hf
from sao_jax.train import metrics
from sao_jax.train import setup
from sao_jax.train import warm_start
from tiny_settings import tiny_config


def _leaves(params):
  return [np.asarray(x) for x in jax.tree.leaves(params)]


def _tiny_run(tmp_path, **overrides):
  """A tiny SFT config, its tokenizer, tasks, model config and a random
  policy saved as the HF checkpoint ``tmp_path/ckpt``."""
  config = tiny_config(**{"train.sft_steps": 3, "train.sft_batch_size": 4,
                          **overrides})
  tokenizer = setup.run_tokenizer(config, str(tmp_path / "tok"), True)
  train_tasks, eval_tasks = env_build.build_tasks(config.env)
  config = task_sizing.resolve(config, tokenizer, (train_tasks, eval_tasks))
  mcfg = setup.model_config_from(config, tokenizer)
  start = warm_start.random_policy(mcfg, 7)
  hf.save_hf_checkpoint(mcfg, start, str(tmp_path / "ckpt"))
  return config, tokenizer, train_tasks, eval_tasks, mcfg, start


def test_sft_warm_starts_the_checkpoint_it_is_given(tmp_path):
  """`model.init_from` + `train.sft_steps` > 0: SFT from the checkpoint
  (not a random init, not skipped), cached under a key with the checkpoint."""
  config, tokenizer, train_tasks, eval_tasks, mcfg, start = _tiny_run(
      tmp_path, **{"train.sft_lr": 1e-6})
  random_key = warm_start.sft_cache_key(config, mcfg, tokenizer)
  config.model.init_from = str(tmp_path / "ckpt")
  config.train.sft_cache_dir = str(tmp_path / "cache")
  assert warm_start.sft_cache_key(config, mcfg, tokenizer) != random_key

  with metrics.MetricWriter(str(tmp_path / "tb")) as writer:
    got = warm_start.initial_policy(config, mcfg, tokenizer, train_tasks,
                                    eval_tasks, str(tmp_path / "run"), writer)
    moved = [np.abs(a - b).max() for a, b in zip(_leaves(got),
                                                 _leaves(start))]
    # 3 Adam steps of lr 1e-6 move every weight by at most ~3e-6: trained,
    # from the checkpoint (a random init differs by ~0.02).
    assert 0 < max(moved) < 1e-4, max(moved)
    again = warm_start.initial_policy(config, mcfg, tokenizer, train_tasks,
                                      eval_tasks, str(tmp_path / "run2"),
                                      writer)  # From the cache.
  for a, b in zip(_leaves(again), _leaves(got)):
    np.testing.assert_array_equal(a, b)
  # Another checkpoint saved at the same path: another cache entry.
  key = warm_start.sft_cache_key(config, mcfg, tokenizer)
  replaced = warm_start.random_policy(mcfg, 8)
  hf.save_hf_checkpoint(mcfg, replaced, str(tmp_path / "ckpt"))
  assert warm_start.sft_cache_key(config, mcfg, tokenizer) != key

  config.train.sft_steps = 0  # No SFT: the checkpoint as it is.
  plain = warm_start.initial_policy(config, mcfg, tokenizer, train_tasks,
                                    eval_tasks, str(tmp_path / "run3"), None)
  for a, b in zip(_leaves(plain), _leaves(replaced)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("overrides", [
    {},
    # Every optional part of the state: the KL penalty's frozen reference
    # and the running-mean baseline's table.
    {"rl.loss": "ppo", "rl.kl_coef": 0.01, "rl.advantage": "running_mean"}])
def test_a_resumed_run_restores_into_an_abstract_state(tmp_path, monkeypatch,
                                                       overrides):
  """setup.build with a checkpoint in the workdir: no initial policy (no
  checkpoint load, random init or SFT: neither run nor cached), the state
  restored as saved, in the shardings a fresh build gives it."""
  config, _, _, _, _, _ = _tiny_run(tmp_path, **{"train.sft_steps": 0,
                                                 **overrides})
  config.model.init_from = str(tmp_path / "ckpt")
  workdir = str(tmp_path / "run")
  with metrics.MetricWriter(str(tmp_path / "tb")) as writer:
    fresh = setup.build(config, workdir, writer, True)
    saved = jax.tree.map(lambda x: x + 1 if x.dtype.kind == "f" else x,
                         fresh.state)  # Not what an init would give.
    fresh.ckpt.save(3, saved, {**fresh.meta, "episodes_consumed": 5})
    fresh.ckpt.close()

    def no_initial_policy(*args, **kwargs):
      raise AssertionError("a resumed run built its initial policy")

    monkeypatch.setattr(warm_start, "initial_policy", no_initial_policy)
    config.train.sft_steps = 3
    config.train.sft_cache_dir = str(tmp_path / "cache")
    resumed = setup.build(config, workdir, writer, True)
    resumed.ckpt.close()
  assert resumed.meta["episodes_consumed"] == 5
  assert not (tmp_path / "cache").exists()
  assert not (tmp_path / "run" / "sft").exists()
  if overrides:
    assert resumed.state.ref_params is not None
    assert resumed.state.running_mean is not None
  leaves = jax.tree.leaves(resumed.state)
  assert leaves and all(isinstance(x, jax.Array) for x in leaves)
  for a, b in zip(leaves, jax.tree.leaves(saved)):
    np.testing.assert_array_equal(a, b)
  assert (jax.tree.map(lambda x: x.sharding, resumed.state)
          == jax.tree.map(lambda x: x.sharding, fresh.state))
