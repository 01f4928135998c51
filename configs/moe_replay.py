r"""Routing replay (R3) study: a tiny MoE policy, replay off vs on, eta 0 and 2.

The quickstart's task (reasoning-gym `basic_arithmetic` with a calculator
tool, its SFT warm start, asynchronous SAO) on a mixture-of-experts policy:
4 layers, width 128, 8 softmax-routed experts (Qwen3-MoE style, q/k norms),
top-2, expert width 96, load-balancing loss 0.01; 5 critic-only and 40 policy
steps. Sampler and trainer both compute in bfloat16 (`model.dtype`; float32
master weights), so their routers can disagree where two experts' scores are
close. Arms (`get_sweep`; experiments/RESULTS.md "Routing replay (R3) on a
tiny MoE"): `train.max_staleness` = `train.publish_lag` in {0, 2} (the
sampler acts with weights eta versions old) crossed with
`model.routing_replay` in {'off', 'rollout'}. Run:

  nice -n 10 python experiments/sweep.py --config=configs/moe_replay.py \
      --workdir=runs/moe_replay --parallel=2
"""

from typing import Any

import ml_collections

from configs import quickstart

ETAS = (0, 2)
REPLAY = ("off", "rollout")
SEEDS = (0,)


def get_config() -> ml_collections.ConfigDict:
  config = quickstart.get_config()
  config.model.dtype = "bfloat16"
  config.model.qk_norm = True  # Qwen3-MoE attention.
  config.model.moe.num_experts = 8
  config.model.moe.top_k = 2
  config.model.moe.intermediate_size = 96
  config.model.moe.router = "softmax"
  config.model.moe.norm_topk_prob = True
  config.model.router_aux_loss_coef = 0.01
  # A shorter RL phase than the quickstart's 150 steps: on this 2-core
  # machine beside other jobs a bf16 MoE step takes ~15 s (RESULTS.md).
  config.rl.critic_warmup_steps = 5
  config.train.num_steps = 40
  config.train.eval_every = 20
  config.train.checkpoint_every = 20
  config.train.log_every = 5
  return config


def get_sweep() -> list[dict[str, Any]]:
  return [{"_name": f"eta{eta}_replay_{replay}_s{seed}",
           "train.max_staleness": eta, "train.publish_lag": eta,
           "model.routing_replay": replay, "train.seed": seed}
          for seed in SEEDS for eta in ETAS for replay in REPLAY]
