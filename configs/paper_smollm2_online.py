r"""Online learning on a real model (issue 40 item 4b): SAO vs GRPO+DIS of
`configs/paper_smollm2.py` on the evolving environment, 2 seeds each.

SmolLM2-135M-Instruct answers `chain_sum` (two one-digit terms) as before,
and the reward also requires a style that changes with the policy version
(`sao_jax/envs/evolving.py`): the reply's last number plain until version
40, inside \boxed{} until 80, inside <answer></answer> after
(`env.answer = 'last_number'`: the style is the wrapper around the last
number). The prompt names all three styles, so the reward alone says which
one is wanted now. Equal rollouts per arm (8 a step, 120 policy steps);
`experiments/report.py`'s adaptation figures (reward by version after each
switch) say how fast each arm recovers.

Run (resumable, one point at a time at low priority):

  nice -n 19 python experiments/sweep.py \
      --config=configs/paper_smollm2_online.py \
      --workdir=runs/paper_smollm2_online --parallel=1
"""

from typing import Any

import ml_collections

from configs import paper_smollm2

SWITCHES = (40, 80)
SEEDS = (0, 1)
ARMS = ("sao", "grpo_dis")


def get_config() -> ml_collections.ConfigDict:
  config = paper_smollm2.get_config()
  config.env.name = "evolving"
  config.env.styles = ("plain", "boxed", "answer_tag")
  config.env.style_change_steps = SWITCHES
  config.env.instruction = (
      " End with the number, written plainly, as \\boxed{N}, or as "
      "<answer>N</answer>.")
  config.train.num_steps = 120
  return config


def get_sweep() -> list[dict[str, Any]]:
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  return [{**arms[arm], "_name": f"{arm}_s{seed}", "train.seed": seed,
           "env.seed": seed} for seed in SEEDS for arm in ARMS]
