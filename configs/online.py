r"""Online-learning simulation: the reward's required answer style changes.

The evolving environment (sao_jax.envs.evolving) scores reasoning-gym
`basic_arithmetic` answers (sums of two digits, which the warm-started
policy mostly gets right without a tool, so the style is what RL must
track) and also requires a style: plain until policy version 60, then
\boxed{...}, from version 120 <answer>...</answer>. The SFT warm start
shows all three styles (one per example in turn), so RL must find out from
the reward alone which one is wanted now; each phase first drives the other
styles down, which the next phase has to undo. Two arms, same samples:
SAO (critic) and the running-mean baseline over the last 128 rewards of any
prompt (`rl.running_mean_scope = 'global'`).

  python experiments/sweep.py --config=configs/online.py --workdir=runs/online
"""

from typing import Any

import ml_collections

from configs import cpu_scale


def get_config() -> ml_collections.ConfigDict:
  config = cpu_scale.get_config()
  config.env.name = "evolving"
  config.env.max_turns = 1
  config.env.styles = ("plain", "boxed", "answer_tag")
  config.env.style_change_steps = (60, 120)
  config.env.dataset_config = ml_collections.ConfigDict({
      "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
      "operators": ("+",), "allow_parentheses": False,
      "allow_negation": False})
  # "<answer>12</answer>" is ~20 byte-fallback tokens.
  config.sampler.max_new_tokens = 32
  config.sampler.max_total_tokens = 64
  config.train.max_seq_len = 64
  config.train.sft_max_len = 64
  config.train.sft_tool_frac = 0.0
  config.train.num_steps = 180
  config.train.max_generated_tokens = 0
  config.train.eval_every = 10
  config.rl.loss = "sao"
  config.rl.advantage = "decoupled_gae"
  return config


def get_sweep() -> list[dict[str, Any]]:
  return [
      {"_name": "sao"},
      {"_name": "running_mean128", "rl.advantage": "running_mean",
       "rl.running_mean_k": 128, "rl.running_mean_scope": "global",
       "rl.critic_warmup_steps": 0},
  ]
