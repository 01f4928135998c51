r"""The paper's setting, one engine samples and another trains (issue 37
item 6): SAO and GRPO (without DIS) of `configs/paper_smollm2.py` with vLLM
behind the sampler's `Rollout` interface (`sampler.engine='vllm'`, the vllm
extra: README "Rollout engines"), seed 0.

Everything else is `configs/paper_smollm2.py`'s, so the two arms see equal
rollouts and the same 256 held-out problems, and each pairs with the native
engine's `sao_s0` / `grpo_s0` of `configs/paper_smollm2_seeds.py`. The
trainer logs per step the ratio of its log-probs to vLLM's on the sampled
tokens (`train/ratio_*`, `train/kl_k2`; for SAO the DIS-masked share), the
cross-engine mismatch DIS exists for.

Run (resumable, one point at a time at low priority):

  nice -n 19 python experiments/sweep.py \
      --config=configs/paper_smollm2_vllm.py \
      --workdir=runs/paper_smollm2_vllm --parallel=1
"""

from typing import Any

from configs import paper_smollm2

ARMS = ("sao", "grpo")
SEED = 0


def get_config():
  config = paper_smollm2.get_config()
  config.sampler.engine = "vllm"
  return config


def get_sweep() -> list[dict[str, Any]]:
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  return [{**arms[arm], "_name": f"{arm}_vllm_s{SEED}", "train.seed": SEED,
           "env.seed": SEED} for arm in ARMS]
