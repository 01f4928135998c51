r"""Why SAO starts slow on a real model (issue 40 item 3): the critic's levers,
one at a time, on `configs/paper_smollm2.py`'s SAO arm at equal rollouts.

In the three-seed comparison (experiments/RESULTS.md §10b) SAO's critic has
an explained variance below 0 (worse than a constant baseline) for its first
30 policy steps and its advantages are narrower than the group z-scores'.
Each point changes one setting of the SAO arm (seed 0, so it pairs with
`configs/paper_smollm2_seeds.py`'s `sao_s0`); the policy still sees 320
rollouts (critic warm-up batches train the critic only):

  sao_head_zero     value head's kernel zero-initialised (V starts at 0, a
                    constant baseline, not the random head's noise);
  sao_warmup20      20 critic warm-up steps instead of 5;
  sao_critic_lr1e4  critic learning rate 1e-4 instead of 2e-5;
  sao_k4            K = 4 critic updates per policy step instead of 2;
  sao_lam_alpha8    lambda_policy = 1 - 1/(8 l) instead of 1 - 1/(1.5 l):
                    closer to Monte Carlo, leaning less on the critic;
  sao_no_warmup, sao_k1, sao_lam_equal: the paper's own ablations, as
                    `configs/paper_smollm2.py` configures them.

Run (resumable, one point at a time at low priority):

  nice -n 19 python experiments/sweep.py \
      --config=configs/paper_smollm2_critic.py \
      --workdir=runs/paper_smollm2_critic --parallel=1

then `python experiments/paper_comparison.py runs/paper_smollm2_critic
--out=experiments/results/paper_smollm2_critic` (with `sao_s0` copied in
as the baseline `sao`).
"""

from typing import Any

from configs import paper_smollm2

SEED = 0
# The levers (name -> the SAO arm's settings it changes), cheapest first.
LEVERS = {
    "sao_head_zero": {"rl.value_head_init_std": 0.0},
    "sao_warmup20": {"rl.critic_warmup_steps": 20},
    "sao_critic_lr1e4": {"optim.critic_lr": 1e-4},
    "sao_k4": {"rl.critic_updates_per_step": 4},
    "sao_lam_alpha8": {"rl.lam_policy_alpha": 8.0},
}
ABLATIONS = ("sao_no_warmup", "sao_k1", "sao_lam_equal")


def get_config():
  return paper_smollm2.get_config()


def get_sweep() -> list[dict[str, Any]]:
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  seed = {"train.seed": SEED, "env.seed": SEED}
  return ([{"_name": name, **change, **seed}
           for name, change in LEVERS.items()]
          + [{**arms[name], **seed} for name in ABLATIONS])
