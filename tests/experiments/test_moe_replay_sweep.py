"""configs/moe_replay.py (the routing-replay study) runs, in a tiny form.

The study's arms (staleness 0 and 2, replay off and on) validate and cross
as experiments/RESULTS.md "Routing replay (R3) on a tiny MoE" says; two of them
(eta 0 without replay, eta 2 with it) train and evaluate end to end through
`experiments/sweep.py` on a tiny MoE, sharing one cached SFT warm start (a
MoE checkpoint), and report the routing metrics.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from configs import moe_replay
from sao_jax import config_validation
from sao_jax.train import metrics as metrics_lib

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ARMS = ("eta0_replay_off_s0", "eta2_replay_rollout_s0")
# A smaller MoE (same 8 experts, top-2), a few SFT and policy steps (no
# critic-only step: a program fewer to compile in each arm).
_TINY = {"model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2,
         "model.num_kv_heads": 1, "model.head_dim": 16,
         "model.moe.intermediate_size": 16, "train.sft_steps": 4,
         "train.num_steps": 2, "train.eval_every": 2, "env.eval_size": 8,
         "rl.critic_warmup_steps": 0, "train.log_every": 1,
         "train.checkpoint_every": 0, "sampler.batch_size": 8,
         "train.batch_size": 8}


def test_arms_cross_staleness_and_replay():
  config = moe_replay.get_config()
  assert config.model.dtype == "bfloat16"
  assert (config.model.moe.num_experts, config.model.moe.top_k) == (8, 2)
  assert config.train.mode == "async"
  points = {p["_name"]: p for p in moe_replay.get_sweep()}
  assert len(points) == 4 * len(moe_replay.SEEDS)
  arms = {(p["train.max_staleness"], p["model.routing_replay"])
          for p in points.values()}
  assert arms == {(0, "off"), (0, "rollout"), (2, "off"), (2, "rollout")}
  for p in points.values():  # The holdback forces the staleness.
    assert p["train.publish_lag"] == p["train.max_staleness"]
  base = config_validation.base_config()
  for p in points.values():  # Every arm's config validates.
    arm = moe_replay.get_config()
    arm.update_from_flattened_dict(
        {k: v for k, v in p.items() if k != "_name"})
    config_validation.validate_config(arm, base)
    assert arm.model.routing_replay == p["model.routing_replay"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tiny_moe_replay_sweep_runs(tmp_path):
  config = tmp_path / "tiny_moe_replay.py"
  config.write_text(textwrap.dedent(f"""
      from configs import moe_replay

      def get_config():
        config = moe_replay.get_config()
        config.update_from_flattened_dict({_TINY!r})
        return config

      get_sweep = moe_replay.get_sweep
      """))
  workdir = tmp_path / "sweep"
  run = subprocess.run(
      [sys.executable, "experiments/sweep.py", f"--config={config}",
       f"--workdir={workdir}", f"--only={','.join(_ARMS)}"],
      capture_output=True, text=True, timeout=1500, cwd=_REPO,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))
  tails = {n: (workdir / n / "log.txt").read_text()[-3000:]
           for n in _ARMS if (workdir / n / "log.txt").exists()}
  assert run.returncode == 0, (run.stderr[-3000:], tails)
  assert len(os.listdir(workdir / "sft_cache")) == 2  # One entry + its lock.
  for name in _ARMS:
    summary = json.loads((workdir / name / "summary.json").read_text())
    assert summary["steps"] == 2, summary
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    scalars = metrics_lib.read_scalars(str(workdir / name / "tb"))
    agreement = [v for _, v in scalars["policy/routing_agreement"]]
    assert agreement and all(0.0 <= v <= 1.0 for v in agreement), agreement
    diff = [v for _, v in scalars["policy/logp_abs_diff"]]
    assert diff and all(0.0 <= v < 50.0 for v in diff), diff
    assert scalars["staleness/max"][-1][1] <= (2 if "eta2" in name else 0)
