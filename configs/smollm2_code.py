r"""SmolLM2-135M-Instruct with the code tool (issue 28 item 3; RESULTS §11).

configs/smollm2.py's model, tokenizer and SAO settings, on reasoning-gym
`basic_arithmetic` with 3-4 terms of 2-4 digits (where computing beats
guessing for a 135M model), with the Python tool in its own ChatML format:
`<tool_call>{"name": "python", "arguments": {"code": "print(...)"}}
</tool_call><|im_end|>`. An SFT warm start on demonstrations in its template
(half calling the tool with `print(EXPRESSION)`, half answering directly)
precedes asynchronous SAO. The same budget without the tool is the sweep's
`no_tool` arm (`get_sweep`): a single-turn task, an instruction without the
tool, demonstrations that all answer directly.

One arm:

  python -m sao_jax.main --config=configs/smollm2_code.py --workdir=/tmp/smollm2_code

Both, resumable over several sessions, then the table
(`--baseline=no_tool`):

  nice -n 19 python experiments/sweep.py --config=configs/smollm2_code.py \
      --workdir=runs/smollm2_code --parallel=1
  python experiments/paper_comparison.py runs/smollm2_code \
      --out=experiments/results/smollm2_code --baseline=no_tool
"""

from typing import Any

import ml_collections

from configs import smollm2

INSTRUCTION = (
    " You may run Python by replying only with <tool_call>{\"name\": "
    "\"python\", \"arguments\": {\"code\": \"print(...)\"}}</tool_call>; its "
    "output comes back to you. End with the final answer as a number.")
NO_TOOL_INSTRUCTION = " End with the final answer as a number."


def get_config() -> ml_collections.ConfigDict:
  config = smollm2.get_config()
  e = config.env
  e.name = "code"
  e.dataset = "basic_arithmetic"
  e.dataset_config = ml_collections.ConfigDict({
      "min_terms": 3, "max_terms": 4, "min_digits": 2, "max_digits": 4,
      "operators": ("+", "-"), "allow_parentheses": False,
      "allow_negation": False})
  e.instruction = INSTRUCTION
  e.answer = "last_number"
  e.max_turns = 3
  e.max_tool_calls = 2
  e.code_mode = "warm"
  e.code_workers = 2
  e.code_preload = ("numpy", "sympy")
  e.code_wall_s = 5.0

  s = config.sampler
  s.max_new_tokens = 96
  s.max_total_tokens = 320  # Prompt ~90, two calls + results + answer.
  config.train.max_seq_len = 320
  t = config.train
  # 480 demonstrations in its own template (60 steps of 8: CPU-sized).
  t.sft_steps = 60
  t.sft_batch_size = 8
  t.sft_lr = 1e-5
  t.sft_max_len = 320
  t.sft_tool_frac = 0.5
  t.batch_size = 8
  s.batch_size = 8
  t.num_steps = 20  # Policy steps (after 5 critic warm-up steps): CPU-sized.
  t.eval_every = 10
  t.checkpoint_every = 5
  return config


def get_sweep() -> list[dict[str, Any]]:
  """With the tool, and the same budget without it."""
  return [
      {"_name": "tool"},
      {"_name": "no_tool", "env.name": "reasoning_gym",
       "env.instruction": NO_TOOL_INSTRUCTION, "env.max_turns": 1,
       "train.sft_tool_frac": 0.0},
  ]
