r"""chain_sum: the quickstart's policy on a task it must compute itself.

reasoning-gym `chain_sum` (sums and differences of 2-3 one-digit terms),
single turn, no calculator tool: the reward comes only from adding right.
Run:

  python -m sao_jax.main --config=configs/chain_sum.py --workdir=/tmp/sao_chain_sum
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  config = quickstart.get_config()
  config.model.name = "chain-sum-1m"
  config.model.vocab_size = 304
  config.tokenizer.vocab_size = 304
  config.tokenizer.datasets = ("chain_sum",)

  config.env.name = "reasoning_gym"
  config.env.max_turns = 1
  config.env.dataset = "chain_sum"
  config.env.dataset_config = ml_collections.ConfigDict({
      "min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1})

  config.sampler.max_total_tokens = 80
  config.train.max_seq_len = 80
  config.train.sft_max_len = 80
  config.train.sft_tool_frac = 0.0
  return config
