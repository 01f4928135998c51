r"""SAO on write-a-function tasks judged by hidden tests: SmolLM2-135M-Instruct
on reasoning-gym's codeio rows (issue 39 item 5; docs/design/grading.md;
RESULTS §12).

`configs/smollm2.py`'s model and SAO settings with the codeio tasks
(`env.dataset = 'codeio'`, references of at most 400 characters: 148
training and 19 held-out rows), whose reward is 1 when the reply's code
passes all 8 hidden tests; lengths derived from the tasks. CPU-sized: an SFT
warm start on the training tasks' reference solutions (16 steps of 4), then
2 critic-only and 10 policy steps of 8 episodes, held-out pass@1 (greedy)
before RL, at step 5 and after.

  nice -n 19 python -m sao_jax.main --config=configs/smollm2_codeio.py \
      --workdir=runs/smollm2_codeio

The same command resumes. HumanEval pass@1 of a run's newest checkpoint
(the `code` extra; README "Evaluation"):

  python -m sao_jax.evaluate --config=configs/smollm2_codeio.py \
      --workdir=runs/smollm2_codeio --config.env.eval_dataset=humaneval

On an accelerator: `--config.model.dtype=bfloat16`, more tasks
(`--config.env.dataset_config.max_reference_chars=1200`, 2k-token rows),
more steps.
"""

import ml_collections

from configs import smollm2


def get_config() -> ml_collections.ConfigDict:
  config = smollm2.get_config()
  e = config.env
  e.dataset = "codeio"
  e.dataset_config = ml_collections.ConfigDict({"max_reference_chars": 400})
  e.answer = "whole"  # The grader takes the reply's last code block.
  e.size = 148  # Training tasks (those of at most 400 characters).
  e.eval_size = 16  # Held-out tasks (of 19; a few give no hidden tests).
  cpu_budget(config)
  return config


def cpu_budget(config: ml_collections.ConfigDict) -> None:
  """The CPU-sized budget of this config and configs/smollm2_repair.py:
  lengths derived from the demonstrations, an SFT warm start of 16 steps
  of 4, 2 critic-only and 10 policy steps of 8 episodes, every layer
  rematerialised."""
  for key in ("max_new_tokens", "max_total_tokens"):
    config.sampler[key] = 0  # Derived from the tasks (envs/task_sizing.py).
  config.sampler.batch_size = 8
  t = config.train
  t.max_seq_len = 0
  t.sft_max_len = 0
  t.sft_steps = 16
  t.sft_batch_size = 4
  t.sft_lr = 1e-5
  t.batch_size = 8
  t.num_steps = 10  # Policy steps (after the critic's warm-up): CPU-sized.
  t.eval_every = 5
  t.checkpoint_every = 2
  t.eval_batch_size = 8
  config.rl.critic_warmup_steps = 2
  config.model.remat_policy = "full"
