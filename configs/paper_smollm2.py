r"""The paper's main comparison on a real model: SAO vs GRPO+DIS vs GRPO.

SmolLM2-135M-Instruct on `configs/smollm2.py`'s task (reasoning-gym
`chain_sum`, two one-digit terms, the reply's last number scored), every arm
asynchronous with the same staleness bound (`train.max_staleness` = 2), the
same trajectories per step (`train.batch_size` = 8) and the same number of
policy steps (`train.num_steps` = 40), so the same number of rollouts reach
the policy loss (320; SAO's critic warm-up adds 5 batches that train the
critic only). Held-out greedy accuracy on 256 problems from disjoint seeds
every 10 policy steps (`train.eval_every`).

Arms (`get_sweep`; experiments/RESULTS.md §10):
  sao            one rollout per prompt, critic baseline, DIS (Eqs. 1-5);
  grpo_dis       groups of 4, group z-score baseline, DIS;
  grpo           groups of 4, group z-score baseline, PPO clip, no DIS;
  sao_no_warmup  SAO without the critic warm-up;
  sao_k1         SAO with K = 1 critic update per policy step;
  sao_lam_equal  SAO with lambda_policy = lambda_critic (plain GAE).

Run (converted checkpoint as in configs/smollm2.py; resumable: rerunning the
same command skips finished arms and resumes unfinished ones from their
checkpoints, every 5 steps, so it can run over several sessions):

  nice -n 19 python experiments/sweep.py --config=configs/paper_smollm2.py \
      --workdir=runs/paper_smollm2 --parallel=1 [--only=sao,grpo_dis,grpo]

then `python experiments/report.py runs/paper_smollm2 --out=OUT`.
"""

from typing import Any

import ml_collections

from configs import smollm2

# Trajectories per step, and of each GRPO group.
BATCH = 8
GROUP = 4

_GROUP_ARM = {"sampler.n_rollouts": GROUP, "rl.advantage": "group_zscore",
              "rl.critic_warmup_steps": 0}  # No critic to warm up.


def get_config() -> ml_collections.ConfigDict:
  config = smollm2.get_config()
  config.train.batch_size = BATCH
  config.sampler.batch_size = BATCH
  config.train.num_steps = 40
  config.train.eval_every = 10
  config.train.checkpoint_every = 5
  config.train.mode = "async"
  config.train.max_staleness = 2
  # Every arm with the remat policy the first arm ran with (the same numbers
  # as smollm2.py's, a different wall time), so the arms' costs compare.
  config.model.remat_policy = "none"
  return config


def get_sweep() -> list[dict[str, Any]]:
  return [
      {"_name": "sao"},
      {"_name": "grpo_dis", "rl.loss": "grpo_dis", **_GROUP_ARM},
      {"_name": "grpo", "rl.loss": "grpo", **_GROUP_ARM},
      {"_name": "sao_no_warmup", "rl.critic_warmup_steps": 0},
      {"_name": "sao_k1", "rl.critic_updates_per_step": 1},
      {"_name": "sao_lam_equal", "rl.advantage": "gae"},
  ]
