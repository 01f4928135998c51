r"""The long-tail workload: the quickstart with agentic episode lengths.

The quickstart's model and tool-use task (sao_jax/envs/longtail.py), where
task ``t`` makes ``k`` tool calls before its answer, ``k`` geometric over
0..4 (half none, one in sixteen four), each answered after
``env.longtail_tool_latency_s`` (1 s: a code sandbox's round trip), and caps
each action at 8 or 16 tokens (``8 * 2**j``, ``j`` geometric over 0..1).
Actions end at their length, so the tail holds for a policy that never stops
(the random-init policy of experiments/bench/async_vs_sync.py
``--workload=longtail``): one episode takes one 8-token action and no tool
time, another five 16-token actions and four tool round trips (4 s). The
continuous-batching sampler (sao_jax/sampler/engine.py) is for that. Run:

  python -m sao_jax.main --config=configs/longtail.py --workdir=/tmp/sao_longtail
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  config = quickstart.get_config()
  env = config.env
  env.name = "tool_longtail"
  env.longtail_levels = 2
  env.longtail_tool_calls = 4
  env.longtail_tool_latency_s = 1.0
  env.max_tool_calls = env.longtail_tool_calls
  env.max_turns = env.longtail_tool_calls + 1
  longest = env.longtail_min_tokens << (env.longtail_levels - 1)
  # The prompt, every action at the longest, a tool result after each call
  # (7 tokens for "error", 3 + digits for a number; a longer one ends the
  # episode as LENGTH).
  total = 32 + env.max_turns * longest + env.longtail_tool_calls * 12
  config.sampler.max_new_tokens = longest
  config.sampler.max_total_tokens = total
  config.sampler.env_threads = config.sampler.batch_size  # Calls sleep.
  config.train.max_seq_len = total
  # Episode lengths vary 4x: one trajectory per row is mostly padding, so
  # rows are packed (docs/design/data_path.md "Packed rows"; BENCHMARKS.md).
  config.train.pack = True
  config.train.sft_max_len = total
  return config
