r"""SAO on write-a-function tasks judged by hidden tests: SmolLM2-135M-Instruct
on reasoning-gym's codeio rows (issue 39; docs/design/grading.md).

`configs/smollm2.py` with the codeio tasks (`env.dataset = 'codeio'`,
references of at most 600 characters), whose reward is 1 when the
reply's code passes all 8 hidden tests; lengths derived from the tasks;
every layer rematerialised (`remat_policy = 'full'`): at 1,200 characters
(2k-token rows) the 8-row step asked for 31 GB.
Held-out: disjoint codeio tasks; `--config.env.eval_dataset=humaneval`
evaluates on HumanEval instead (the `code` extra). Converted checkpoint as
in configs/smollm2.py.

  python -m sao_jax.main --config=configs/smollm2_codeio.py \
      --workdir=/tmp/smollm2_codeio
"""

import ml_collections

from configs import smollm2


def get_config() -> ml_collections.ConfigDict:
  config = smollm2.get_config()
  e = config.env
  e.dataset = "codeio"
  e.dataset_config = ml_collections.ConfigDict({"max_reference_chars": 600})
  e.answer = "whole"  # The grader takes the reply's last code block.
  e.size = 300  # Training tasks (of those that fit the length limit).
  e.eval_size = 32  # Held-out tasks.
  for key in ("max_new_tokens", "max_total_tokens"):
    config.sampler[key] = 0  # Derived from the tasks (envs/task_sizing.py).
  config.sampler.batch_size = 8
  config.train.max_seq_len = 0
  config.train.sft_max_len = 0
  config.train.batch_size = 8
  config.model.remat_policy = "full"
  config.train.eval_batch_size = 8  # 2k-token caches: 64 rows need ~12 GiB.
  return config
