"""The AOT command's abstract programs are the run's own (no libtpu needed).

The abstract train state (shapes, dtypes and shardings) must be what
``train.setup`` builds for a real run, leaf for leaf, or the compiled
figures would be of another program.
"""

import jax
import numpy as np
import pytest

from sao_jax import sharding
from sao_jax.aot import programs
from sao_jax.ipc import weights
from sao_jax.sampler import generate
from sao_jax.train import setup
from sao_jax.train import warm_start
from configs import base


def _run_and_abstract(config):
  mcfg = programs.model_config(config)
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.normalize_rules(config.mesh.rules)
  step_cfg = setup.step_config_from(config)
  abstract, shardings, _, _ = programs.abstract_train_state(
      config, mcfg, step_cfg, mesh, rules)
  state, state_sharding, _, _ = setup._train_state(  # pylint: disable=protected-access
      config, mcfg, step_cfg, warm_start.random_policy(mcfg, 0),
      int(config.env.size), mesh, rules)
  return abstract, shardings, state, state_sharding


@pytest.mark.parametrize("overrides", [
    {},  # SAO: critic with frozen attention (masked moments).
    {"rl.critic_frozen_attention": False, "rl.loss": "grpo",
     "rl.kl_coef": 0.1},  # A reference policy.
    {"rl.advantage": "running_mean", "env.size": 37},  # A running-mean table.
])
def test_abstract_state_is_the_runs_state(overrides):
  config = base.get_config()
  for key, value in overrides.items():
    section, name = key.split(".")
    config[section][name] = value
  abstract, shardings, state, state_sharding = _run_and_abstract(config)
  assert (jax.tree.structure(abstract) == jax.tree.structure(state))
  for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(state)):
    assert (a.shape, a.dtype) == (s.shape, s.dtype)
  specs = lambda tree: [x.spec for x in jax.tree.leaves(tree)]
  assert specs(shardings) == specs(state_sharding)
  assert specs(jax.tree.map(lambda x: x.sharding, abstract)) == specs(
      state_sharding)
  # Params and moments are split over 'fsdp' (not all replicated).
  assert any("fsdp" in str(spec) for spec in specs(state_sharding))


def test_sampler_shapes_follow_the_generator():
  config = base.get_config()
  config.sampler.max_total_tokens = 300
  config.sampler.max_new_tokens = 40
  config.sampler.decode_chunk = 12
  shapes = programs.sampler_shapes(config)
  assert shapes["cache_len"] == 304  # Multiple of 8 >= 300.
  assert shapes["prefill_len"] == generate.bucket_length(260, 8) == 512
  assert shapes["decode_steps"] == 16  # bucket_length(min(12, 40)).
  assert shapes["slots"] == 16  # num_slots 0: sampler.batch_size.
  assert shapes["prefill_rows"] == 16  # prefill_rows 0: all slots a call.
  config.sampler.kv_on_swap = "recompute"  # Whole histories re-prefilled.
  assert programs.sampler_shapes(config)["prefill_len"] == 512
  config.sampler.prefill_rows = 4  # The Generator feeds 4 rows a call.
  assert programs.sampler_shapes(config)["prefill_rows"] == 4
  config.sampler.prefill_rows = 32  # Above the slots: no limit.
  assert programs.sampler_shapes(config)["prefill_rows"] == 16


def test_weight_slot_size_is_what_create_allocates():
  config = base.get_config()
  mcfg = programs.model_config(config)
  params = warm_start.random_policy(mcfg, 0)
  with weights.WeightSlot.create(params) as slot:
    allocated = slot._shm.size  # pylint: disable=protected-access
  assert programs.weight_slot_bytes(mcfg) == weights.slot_bytes(params)
  assert weights.slot_bytes(params) <= allocated < weights.slot_bytes(
      params) + 4096 * 4
  raw = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
  assert 2 * raw < weights.slot_bytes(params) < 2 * raw + 2**20


def test_derived_lengths_and_vocab_are_refused():
  config = base.get_config()
  config.train.max_seq_len = 0
  with pytest.raises(ValueError, match="train.max_seq_len=0"):
    programs.check_explicit_lengths(config)
  config.model.vocab_size = 0
  with pytest.raises(ValueError, match="vocab_size=0"):
    programs.model_config(config)
