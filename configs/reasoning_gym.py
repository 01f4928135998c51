r"""Any reasoning-gym task with one override: settings that follow the task.

The quickstart's policy (~0.9M parameters, SFT warm start, then asynchronous
SAO on CPU), single turn and without the calculator tool, on whichever
reasoning-gym dataset `env.dataset` names (default settings of that dataset;
`--config.env.dataset_config.K=V` changes one). Nothing else depends on the
task by hand: at start-up (docs/design/envs.md "Settings that follow the
task")

- the tokenizer trains on the task's own problems (`tokenizer.datasets=()`)
  with a soft vocabulary limit (`tokenizer.vocab_size=0`: at most 512 pieces,
  or as many as the task's characters need);
- the model's vocabulary is the tokenizer's size rounded up to a multiple of
  64 (`model.vocab_size=0`);
- prompt and answer lengths are measured on the task's problems and
  `sampler.max_new_tokens`, `sampler.max_total_tokens`, `train.max_seq_len`
  and `train.sft_max_len` (0 here) are set to what they need;

and the log says what was chosen. The answer is the whole final reply, scored
by the dataset's own `score_answer` (exact: reward 1 iff full credit), for
numbers, words, lists and grids alike. Run:

  python -m sao_jax.main --config=configs/reasoning_gym.py \
      --workdir=/tmp/sao_rg --config.env.dataset=letter_counting
"""

import ml_collections

from configs import quickstart
from sao_jax.envs import task_sizing


def get_config() -> ml_collections.ConfigDict:
  config = quickstart.get_config()
  derive = task_sizing.DERIVE
  config.model.vocab_size = derive
  config.tokenizer.vocab_size = derive
  config.tokenizer.datasets = ()  # The run's own env.dataset.

  config.env.name = "reasoning_gym"
  config.env.max_turns = 1
  config.env.dataset = "chain_sum"
  config.env.dataset_config = ml_collections.ConfigDict()

  config.sampler.max_new_tokens = derive
  config.sampler.max_total_tokens = derive
  config.train.max_seq_len = derive
  config.train.sft_max_len = derive
  config.train.sft_tool_frac = 0.0

  # A budget for sweeping eight tasks on a shared 2-core CPU in about an
  # hour (experiments/RESULTS.md §9): an eighth of the quickstart's SFT
  # examples (100 steps of 32) and 30 policy steps after 5 critic-only steps.
  config.train.sft_steps = 100
  config.train.sft_batch_size = 32
  config.rl.critic_warmup_steps = 5
  config.train.num_steps = 30
  config.train.eval_every = 15
  config.train.checkpoint_every = 15
  return config
