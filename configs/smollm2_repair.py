r"""SAO on repository repair: SmolLM2-135M-Instruct fixes one injected bug in
a small real package with tools (issue 39 item 2; docs/design/grading.md
"Repository repair").

`configs/smollm2.py`'s model and SAO settings on `env.name = 'repair'` (all
workspaces; `env.dataset_config.workspaces` picks some): up to 5 tool calls
(`read_file`, `write_file`, `str_replace`, `run_tests`) in SmolLM2's own
`<tool_call>` format, then the submission, rewarded 1 when the task's tests
pass on a clean tree. An SFT warm start on the reference fixes' scripted
episodes (`RepairTasks.entry`), lengths derived from them; the CPU-sized
budget of configs/smollm2_codeio.py. Held out: seeds = 9 mod 10.

  nice -n 19 python -m sao_jax.main --config=configs/smollm2_repair.py \
      --workdir=runs/smollm2_repair
"""

import ml_collections

from configs import smollm2
from configs import smollm2_codeio


def get_config() -> ml_collections.ConfigDict:
  config = smollm2.get_config()
  e = config.env
  e.name = "repair"
  e.dataset_config = ml_collections.ConfigDict({})  # Every workspace.
  e.size = 64
  e.eval_size = 16
  e.max_turns = 6
  e.max_tool_calls = 5
  smollm2_codeio.cpu_budget(config)
  return config
