r"""chain_sum: the quickstart's policy on sums it must compute itself.

reasoning-gym `chain_sum` (2-3 one-digit terms, `+`/`-`), single turn, no
calculator tool: the reward (1 iff reasoning-gym gives full credit) comes
only from adding right. The tokenizer and model vocabulary (304) and the
lengths (prompts need 61-65 tokens, answers 2-4) fit this task. At this model
size and budget RL does *not* lift held-out accuracy over the SFT warm start
(experiments/RESULTS.md, "chain_sum diagnosis", says why); this config is the
setting of that diagnosis. Run:

  python -m sao_jax.main --config=configs/chain_sum.py --workdir=/tmp/sao_chain_sum
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  config = quickstart.get_config()
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
