r"""The long-tail workload: the quickstart with answer lengths varying 16x.

The quickstart's model and tool-use task, where task ``t`` caps each action at
``8 * 2**j`` tokens, ``j`` geometric over 0..4 (half the tasks 8 tokens, one
in sixteen 128; sao_jax/envs/longtail.py). Episode lengths then have the long
tail of agentic work, which the continuous-batching sampler
(sao_jax/sampler/engine.py) is for; experiments/bench/async_vs_sync.py
``--workload=longtail`` measures it. Run:

  python -m sao_jax.main --config=configs/longtail.py --workdir=/tmp/sao_longtail
"""

import ml_collections

from configs import quickstart


def get_config() -> ml_collections.ConfigDict:
  config = quickstart.get_config()
  config.env.name = "tool_longtail"
  longest = config.env.longtail_min_tokens << (config.env.longtail_levels - 1)
  config.sampler.max_new_tokens = longest
  config.sampler.max_total_tokens = 32 + longest
  config.train.max_seq_len = 32 + longest
  config.train.sft_max_len = 32 + longest
  return config
