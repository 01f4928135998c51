r"""The code tool from scratch: a tiny policy learns to run Python.

The quickstart's ~0.9M-parameter policy and sentencepiece tokenizer, on
reasoning-gym `basic_arithmetic` with two or three 2-3 digit terms (sums and
differences this model cannot compute in its head), with the code tool
(`env.name='code'`, sao_jax/envs/code_env.py): a call is
`<|tool_call|>print(123 + 45)<|/tool_call|>`, the sandbox's stdout comes back
as the observation. The SFT warm start shows half of its demonstrations
calling the tool with `print(EXPRESSION)` and half answering directly; then
asynchronous SAO learns from the reward alone which way pays. Compare with
`--config.env.name=reasoning_gym --config.train.sft_tool_frac=0` (the same
budget without the tool). Run:

  python -m sao_jax.main --config=configs/code_quickstart.py --workdir=/tmp/sao_code
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  config = quickstart.get_config()
  config.env.name = "code"
  config.env.dataset_config = ml_collections.ConfigDict({
      "min_terms": 2, "max_terms": 3, "min_digits": 2, "max_digits": 3,
      "operators": ("+", "-"), "allow_parentheses": False,
      "allow_negation": False})
  config.env.code_mode = "warm"
  config.env.code_workers = 1  # Per process: the sampler's and the trainer's.
  config.env.code_wall_s = 2.0
  config.env.step_timeout_s = 30.0

  # Lengths follow the demonstrations (0 = derive, envs/task_sizing.py).
  config.sampler.max_new_tokens = 0
  config.sampler.max_total_tokens = 0
  config.train.max_seq_len = 0
  config.train.sft_max_len = 0
  config.train.sft_tool_frac = 0.5
  return config
