r"""Quickstart: SFT warm start, then asynchronous agentic SAO on CPU.

A ~0.9M-parameter Llama-style policy answers reasoning-gym's
`basic_arithmetic` problems (sums and differences of 2-3 small numbers) and
may call a calculator tool (multi-turn episodes: the tool result is an
environment observation, mask 0, skipped by the GAE recursion). A short
supervised warm start shows it both ways of answering: mostly directly
(which this small model gets right only sometimes) and a quarter of the time
through the calculator. Single-rollout asynchronous RL (one sampler process,
one trainer process, trajectories through the shared-memory ring) then learns
from the task's reward alone which way pays. Held-out accuracy (greedy,
reasoning-gym's scorer, problems whose seeds training never uses) is reported
before and after RL. Run:

  python -m sao_jax.main --config=configs/quickstart.py --workdir=/tmp/sao_quickstart
"""

import ml_collections

from configs import base


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  config.model.vocab_size = 294
  config.model.hidden_size = 128
  config.model.intermediate_size = 384
  config.model.num_layers = 4
  config.model.num_heads = 4
  config.model.num_kv_heads = 2
  config.model.head_dim = 32

  config.tokenizer.vocab_size = 294
  config.tokenizer.datasets = ("basic_arithmetic",)
  config.tokenizer.corpus_size = 2000

  config.env.name = "tool"
  config.env.max_turns = 3
  config.env.max_tool_calls = 1
  config.env.dataset = "basic_arithmetic"
  config.env.dataset_config = ml_collections.ConfigDict({
      "min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1,
      "operators": ("+", "-"), "allow_parentheses": False,
      "allow_negation": False})
  config.env.size = 20_000
  config.env.eval_seed = 10_000_000
  config.env.eval_size = 256

  config.sampler.max_new_tokens = 16
  config.sampler.max_total_tokens = 48
  config.sampler.batch_size = 32
  # 32 slots of a 0.9M-parameter model: a masked full-batch forward costs
  # less than compiling the row-subset shapes (docs/design/sampler.md
  # "Continuous batching").
  config.sampler.row_subsets = False

  config.rl.critic_warmup_steps = 10
  config.optim.actor_lr = 2e-4
  config.optim.critic_lr = 1e-3

  config.train.mode = "async"
  config.train.num_steps = 150
  config.train.batch_size = 32
  config.train.max_seq_len = 48
  config.train.max_staleness = 2
  config.train.eval_every = 50
  config.train.checkpoint_every = 50
  config.train.log_every = 10
  config.train.sft_steps = 400
  config.train.sft_batch_size = 64
  config.train.sft_lr = 3e-3
  config.train.sft_max_len = 48
  config.train.sft_tool_frac = 0.25
  return config
