r"""Shared settings of the CPU-scale paper reproduction (experiments/RESULTS.md).

Every comparison and ablation config starts here and changes only what its
arm is about. The setting is the quickstart's agentic task (reasoning-gym
`basic_arithmetic` with a calculator tool, multi-turn episodes) and its
~0.9M-parameter policy, with:

* one shared SFT warm start (`train.sft_seed` fixed, cached by the sweep in
  `<sweep dir>/sft_cache`), so every arm and seed starts from the same policy
  and `train.seed` varies only the RL run (sampling, critic head init);
* SFT demonstrations drawn from their own problems (`train.sft_data_seed`),
  disjoint from RL's and from the held-out ones, so RL's prompts are new to
  the policy;
* a 1,024-problem RL training set, so prompts recur (~4 visits per prompt
  for SAO), which the per-prompt running-mean baseline needs;
* an equal budget of generated tokens for every arm
  (`train.max_generated_tokens`); `train.num_steps` is only a cap. The critic
  warm-up's trajectories count against the budget.

`get_sweep()` gives the seeds; run an arm with

  python experiments/sweep.py --config=configs/sao.py --workdir=runs/main/sao
"""

from typing import Any

import ml_collections

from configs import quickstart

# Seeds of the main comparison (>= 2 per arm).
SEEDS = (0, 1, 2)
# Generated (action) tokens per run: ~120 SAO steps of 32 trajectories.
TOKEN_BUDGET = 36_000


def get_config() -> ml_collections.ConfigDict:
  config = quickstart.get_config()
  config.env.size = 1024
  config.train.sft_data_seed = 5_000_000
  config.train.num_steps = 400  # Cap; the token budget ends the run first.
  config.train.max_generated_tokens = TOKEN_BUDGET
  config.train.eval_every = 5  # Fine enough to time tokens-to-target.
  config.train.log_every = 5
  config.train.checkpoint_every = 50
  config.train.sft_seed = 0
  return config


def seed_sweep(seeds: tuple[int, ...] = SEEDS) -> list[dict[str, Any]]:
  """One sweep point per RL seed, named seed<k>."""
  return [{"_name": f"seed{s}", "train.seed": s} for s in seeds]


def grpo_overrides(config: ml_collections.ConfigDict) -> None:
  """GRPO-family sampling: 8 rollouts per prompt, no critic warm-up."""
  config.sampler.n_rollouts = 8
  config.rl.advantage = "group_zscore"
  config.rl.critic_warmup_steps = 0  # No critic: nothing to warm up.
