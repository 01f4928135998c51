"""Every config in configs/ builds and validates, and so does every sweep point.

Also the experiment knobs of the loop: the weight-publication holdback, the
SFT styles of the evolving env, the SFT cache key and the global running mean.
"""

import importlib
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax import config_overrides as overrides_lib
from sao_jax import config_validation as cv
from sao_jax.data import record
from sao_jax.envs import evolving
from sao_jax.envs import build as env_build
from sao_jax.envs import reasoning_gym_env as rg_env
from sao_jax.rl import advantages as adv_lib
from sao_jax.train import warm_start
from sao_jax.train import step as step_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.stem for p in (REPO / "configs").glob("*.py")
                 if p.stem != "__init__")


@pytest.mark.parametrize("name", CONFIGS)
def test_config_and_its_sweep_points_validate(name):
  module = importlib.import_module(f"configs.{name}")
  base = cv.base_config()
  cv.validate_config(module.get_config(), base)
  points = getattr(module, "get_sweep", lambda: [{}])()
  assert points, f"configs/{name}.py: get_sweep() returned no points"
  names = [p.get("_name") for p in points]
  assert len(set(names)) == len(names), names
  for point in points:
    config = module.get_config()
    overrides_lib.apply_overrides(config, {k: v for k, v in point.items()
                                if k != "_name"}, base)
    cv.validate_config(config, base)


def test_arms_differ_only_in_what_they_ablate():
  from configs import cpu_scale, grpo, grpo_dis, sao, sao_no_fast_value  # pylint: disable=g-import-not-at-top,g-multiple-import
  ref = sao.get_config().to_dict()
  diff = lambda c: set(record.differing_keys(ref, c.to_dict()))
  assert diff(sao_no_fast_value.get_config()) == {"rl.critic_updates_per_step"}
  assert diff(grpo.get_config()) == {
      "rl.loss", "rl.advantage", "sampler.n_rollouts",
      "rl.critic_warmup_steps"}
  assert diff(grpo_dis.get_config()) == diff(grpo.get_config())
  # Equal generated-token budgets and one shared SFT warm start.
  for c in (grpo.get_config(), grpo_dis.get_config(), sao.get_config()):
    assert c.train.max_generated_tokens == cpu_scale.TOKEN_BUDGET
    assert c.train.sft_seed == 0 and c.train.sft_data_seed is not None


def test_format_style_round_trips():
  assert evolving.format_style("12", "boxed") == "\\boxed{12}"
  assert evolving.format_style("12", "answer_tag") == "<answer>12</answer>"
  assert evolving.format_style("12", "plain") == "12"
  for style in evolving.STYLES:
    assert evolving.parse_style(evolving.format_style("7", style)) == (
        style, "7")
  with pytest.raises(ValueError, match="Unknown style"):
    evolving.format_style("1", "bold")


def test_global_running_mean_pools_all_prompts():
  cfg = step_lib.StepConfig(advantage="running_mean", running_mean_global=True)
  state = adv_lib.running_mean_init(1, 4)
  mask = jnp.ones((3, 2), jnp.float32)
  batch = {"rewards": jnp.array([[0, 1], [0, 0], [0, 1]], jnp.float32),
           "action_mask": mask, "prompt_id": jnp.array([5, 9, 700])}
  adv, _, state = step_lib.compute_advantages(cfg, batch, jnp.zeros_like(mask), state)
  # Empty history: baseline 0, advantage = reward.
  np.testing.assert_allclose(np.asarray(adv[:, 0]), [1, 0, 1])
  adv, _, state = step_lib.compute_advantages(cfg, batch, jnp.zeros_like(mask), state)
  # Baseline = mean of the 3 rewards seen (any prompt) = 2/3.
  np.testing.assert_allclose(np.asarray(adv[:, 0]), [1 / 3, -2 / 3, 1 / 3],
                             rtol=1e-6)


def test_sft_tasks_are_their_own_problems_disjoint_from_rl_and_held_out():
  from configs import cpu_scale  # pylint: disable=g-import-not-at-top
  config = cpu_scale.get_config()
  train, held_out = env_build.build_tasks(config.env)
  tasks = warm_start.sft_tasks(config, train, held_out)
  assert (tasks.seed, len(tasks)) == (5_000_000, warm_start.MAX_SFT_EXAMPLES)
  assert tasks.entry(0) == rg_env.ReasoningGymTasks(
      train.name, dict(config.env.dataset_config), seed=5_000_000,
      size=1).entry(0)
  config.train.sft_data_seed = None
  assert warm_start.sft_tasks(config, train, held_out) is train
  for seed, label in ((1000, "RL training"),
                      (config.env.eval_seed - 10, "held-out")):
    config.train.sft_data_seed = seed
    with pytest.raises(ValueError,
                       match=f"SFT .* overlap {label} seeds .*sft_data_seed"):
      warm_start.sft_tasks(config, train, held_out)
