r"""SAO on repository repair: SmolLM2-135M-Instruct fixes one injected bug in
a small real package with tools (issue 39 item 2; docs/design/grading.md
"Repository repair").

`configs/smollm2.py`'s model and SAO settings on `env.name = 'repair'` (all
workspaces; `env.dataset_config.workspaces` picks some): up to 5 tool calls
(`read_file`, `write_file`, `str_replace`, `run_tests`) in SmolLM2's own
`<tool_call>` format, then the submission, rewarded 1 when the task's tests
pass on a clean tree. An SFT warm start on the reference fixes' scripted
episodes (`RepairTasks.entry`), lengths derived from them. Held out: seeds
= 9 mod 10.

  nice -n 19 python -m sao_jax.main --config=configs/smollm2_repair.py \
      --workdir=runs/smollm2_repair
"""

import ml_collections

from configs import smollm2


def get_config() -> ml_collections.ConfigDict:
  config = smollm2.get_config()
  e = config.env
  e.name = "repair"
  e.dataset_config = ml_collections.ConfigDict({})  # Every workspace.
  e.size = 64
  e.eval_size = 16
  e.max_turns = 6
  e.max_tool_calls = 5
  for key in ("max_new_tokens", "max_total_tokens"):
    config.sampler[key] = 0  # Derived from the demonstrations.
  config.sampler.batch_size = 8
  t = config.train
  t.max_seq_len = 0
  t.sft_max_len = 0
  t.sft_steps = 16
  t.sft_batch_size = 4
  t.sft_lr = 1e-5
  t.batch_size = 8
  t.num_steps = 10
  t.eval_every = 5
  t.eval_batch_size = 8
  config.rl.critic_warmup_steps = 2
  config.model.remat_policy = "full"
  return config
