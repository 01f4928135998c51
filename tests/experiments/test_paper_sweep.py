"""configs/paper_smollm2.py (the paper's main comparison) runs, in a tiny form.

The sweep's own arms, through `experiments/sweep.py`, on a tiny random
checkpoint that speaks SmolLM2-135M-Instruct's own tokenizer and chat
template (its files copied from the converted checkpoint), so the command of
experiments/RESULTS.md §10 cannot rot: every arm's config validates, two arms
(single-rollout SAO and grouped GRPO+DIS) train and evaluate end to end, and
a rerun skips them.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from configs import paper_smollm2
from configs import paper_smollm2_critic
from configs import paper_smollm2_online
from configs import paper_smollm2_seeds
from configs import paper_smollm2_stability
from configs import paper_smollm2_staleness
from configs import paper_smollm2_vllm
import smollm2_checkpoint
from sao_jax import config_validation
from sao_jax.models import hf
from sao_jax.train import warm_start
import tiny_models

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The tiny model: SmolLM2's vocabulary, everything else small.
_TINY = {f"model.{k}": v for k, v in tiny_models.TINY_MODEL.items()
         if k != "vocab_size"}
# Two policy steps, evaluations on 8 problems after each, short replies; one
# critic-only step where the config has 5 (test_arms_compare_at_equal_rollouts
# checks the 5), so the SAO arm still differs from GRPO+DIS (none) in steps.
_SHORT = {"train.num_steps": 2, "train.eval_every": 1, "env.eval_size": 8,
          "train.checkpoint_every": 1, "sampler.max_new_tokens": 8,
          "train.max_seq_len": 80, "sampler.max_total_tokens": 80,
          "rl.critic_warmup_steps": 1}


def test_arms_compare_at_equal_rollouts():
  config = paper_smollm2.get_config()
  points = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  assert set(points) == {"sao", "grpo_dis", "grpo", "sao_no_warmup", "sao_k1",
                         "sao_lam_equal"}
  assert config.train.mode == "async"
  assert config.train.batch_size == config.sampler.batch_size == 8
  assert (config.train.num_steps, config.train.eval_every) == (40, 10)
  assert config.rl.critic_warmup_steps == 5  # SAO's; the group arms' none.
  assert config.env.eval_size == 256
  for name in ("grpo_dis", "grpo"):
    assert points[name]["sampler.n_rollouts"] == 4
    assert 8 % points[name]["sampler.n_rollouts"] == 0  # Whole groups a step.
    assert points[name]["rl.critic_warmup_steps"] == 0
  assert points["grpo"]["rl.loss"] == "grpo"
  assert points["grpo_dis"]["rl.loss"] == "grpo_dis"
  assert config.rl.loss == "sao" and config.sampler.n_rollouts == 1


def test_seed_sweep_pairs_the_three_arms():
  """configs/paper_smollm2_seeds.py: SAO, GRPO+DIS, GRPO x 3 seeds, each
  seed the same for its arms (train and problem seeds), the arms otherwise
  as in paper_smollm2, seeds outermost (a seed's arms finish together)."""
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  points = paper_smollm2_seeds.get_sweep()
  assert [p["_name"] for p in points] == [
      f"{a}_s{s}" for s in (0, 1, 2) for a in ("sao", "grpo_dis", "grpo")]
  for p in points:
    arm, seed = p["_name"].rsplit("_s", 1)
    assert p["train.seed"] == p["env.seed"] == int(seed)
    assert {k: v for k, v in p.items()
            if k not in ("_name", "train.seed", "env.seed")} == {
                k: v for k, v in arms[arm].items() if k != "_name"}
  assert (paper_smollm2_seeds.get_config().to_dict()
          == paper_smollm2.get_config().to_dict())



def test_staleness_sweep_sets_eta_as_bound_and_lag():
  """configs/paper_smollm2_staleness.py: the three arms at eta 16, 0, 4 with
  seed 0, then at eta 16 with seed 1; each point's staleness bound and
  publication lag are its eta, and every config validates."""
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  points = paper_smollm2_staleness.get_sweep()
  assert [p["_name"] for p in points] == [
      f"{a}_eta{e}_s{s}" for e, s in ((16, 0), (0, 0), (4, 0), (16, 1))
      for a in ("sao", "grpo_dis", "grpo")]
  for p in points:
    arm, eta, seed = re.fullmatch(r"(\w+)_eta(\d+)_s(\d)", p["_name"]).groups()
    assert p["train.max_staleness"] == p["train.publish_lag"] == int(eta)
    assert p["train.seed"] == p["env.seed"] == int(seed)
    assert {k: v for k, v in p.items() if k not in (
        "_name", "train.seed", "env.seed", "train.max_staleness",
        "train.publish_lag")} == {
            k: v for k, v in arms[arm].items() if k != "_name"}
    config = paper_smollm2_staleness.get_config()
    config.update_from_flattened_dict(
        {k: v for k, v in p.items() if k != "_name"})
    config_validation.validate_config(config)
  assert (paper_smollm2_staleness.get_config().to_dict()
          == paper_smollm2.get_config().to_dict())


def _is_arm_with_seed(module, point, arm, seed=0):
  """Checks that sweep ``point`` of config ``module`` is the paper config's
  ``arm`` at ``seed`` and nothing else; returns its validated config."""
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  assert point["train.seed"] == point["env.seed"] == seed
  assert {k: v for k, v in point.items() if k not in (
      "_name", "train.seed", "env.seed")} == {
          k: v for k, v in arms[arm].items() if k != "_name"}
  config = module.get_config()
  config.update_from_flattened_dict(
      {k: v for k, v in point.items() if k != "_name"})
  config_validation.validate_config(config)
  return config


def test_vllm_sweep_is_the_paper_setting_with_vllm_rollouts():
  """configs/paper_smollm2_vllm.py: SAO and GRPO (no DIS), seed 0, each the
  paper config's arm with only the engine changed; both validate (vLLM
  reports exact log-probs only without top-p/top-k truncation)."""
  points = paper_smollm2_vllm.get_sweep()
  assert [p["_name"] for p in points] == ["sao_vllm_s0", "grpo_vllm_s0"]
  config = paper_smollm2_vllm.get_config()
  assert config.sampler.engine == "vllm"
  config.sampler.engine = "native"
  assert config.to_dict() == paper_smollm2.get_config().to_dict()
  for p, arm in zip(points, ("sao", "grpo")):
    config = _is_arm_with_seed(paper_smollm2_vllm, p, arm)
    config.sampler.top_p = 0.9
    with pytest.raises(ValueError, match="top_p"):
      config_validation.validate_config(config)

def test_critic_sweep_changes_one_setting_of_the_sao_arm():
  """configs/paper_smollm2_critic.py: every lever is the SAO arm (seed 0) with
  one setting changed from the paper config's value; the paper's ablations as
  configured; all validate."""
  base = paper_smollm2.get_config()
  assert paper_smollm2_critic.get_config().to_dict() == base.to_dict()
  points = {p["_name"]: p for p in paper_smollm2_critic.get_sweep()}
  assert list(points) == [*paper_smollm2_critic.LEVERS, "sao_no_warmup",
                          "sao_k1", "sao_lam_equal"]
  arms = {p["_name"]: p for p in paper_smollm2.get_sweep()}
  flat = {f"{s}.{k}": v for s, sub in base.items() if hasattr(sub, "items")
          for k, v in sub.items()}
  for name, p in points.items():
    assert p["train.seed"] == p["env.seed"] == 0
    change = {k: v for k, v in p.items()
              if k not in ("_name", "train.seed", "env.seed")}
    if name in arms:
      assert change == {k: v for k, v in arms[name].items() if k != "_name"}
    else:
      ((key, value),) = change.items()  # One setting.
      assert flat[key] != value, (name, key)
    config = paper_smollm2_critic.get_config()
    config.update_from_flattened_dict(
        {k: v for k, v in p.items() if k != "_name"})
    config_validation.validate_config(config)
  config.rl.value_head_init_std = -0.1
  with pytest.raises(ValueError, match="value_head_init_std"):
    config_validation.validate_config(config)


def test_stability_sweep_is_the_paper_setting_for_300_steps():
  """configs/paper_smollm2_stability.py: SAO and GRPO, seed 0, 300 policy
  steps, evaluations every 25; otherwise the paper config and its arms."""
  config = paper_smollm2_stability.get_config()
  assert (config.train.num_steps, config.train.eval_every) == (300, 25)
  config.train.num_steps, config.train.eval_every = 40, 10
  config.train.checkpoint_every = 5
  assert config.to_dict() == paper_smollm2.get_config().to_dict()
  points = paper_smollm2_stability.get_sweep()
  assert [p["_name"] for p in points] == ["sao_300_s0", "grpo_300_s0"]
  for p, arm in zip(points, ("sao", "grpo")):
    config = _is_arm_with_seed(paper_smollm2_stability, p, arm)
    assert config.train.max_staleness == 2


def test_online_sweep_is_the_paper_setting_on_the_evolving_env():
  """configs/paper_smollm2_online.py: SAO and GRPO+DIS, seeds 0 and 1, the
  paper config on the evolving env (styles switching at versions 40 and
  80, read around the reply's last number); all validate."""
  config = paper_smollm2_online.get_config()
  assert config.env.name == "evolving" and config.env.answer == "last_number"
  assert tuple(config.env.style_change_steps) == (40, 80)
  assert config.train.num_steps == 120
  for key in ("styles", "style_change_steps", "instruction"):
    config.env[key] = paper_smollm2.get_config().env[key]
  config.env.name, config.train.num_steps = "reasoning_gym", 40
  assert config.to_dict() == paper_smollm2.get_config().to_dict()
  points = paper_smollm2_online.get_sweep()
  assert [p["_name"] for p in points] == ["sao_s0", "grpo_dis_s0", "sao_s1",
                                          "grpo_dis_s1"]
  for p in points:
    arm, seed = p["_name"].rsplit("_s", 1)
    _is_arm_with_seed(paper_smollm2_online, p, arm, int(seed))


def _tiny_checkpoint(smollm2_dir: str, out: str) -> None:
  mcfg = tiny_models.tiny_model_config(
      vocab_size=49152, rope_theta=100000.0,
      rms_norm_eps=9.999999747378752e-06, tie_embeddings=True)
  hf.save_hf_checkpoint(mcfg, warm_start.random_policy(mcfg, 0), out)
  for name in os.listdir(smollm2_dir):
    if "token" in name or "template" in name or name.startswith("special"):
      shutil.copy(os.path.join(smollm2_dir, name), out)


def _sweep(config_path, workdir):
  return subprocess.run(
      [sys.executable, "experiments/sweep.py", f"--config={config_path}",
       f"--workdir={workdir}", "--only=sao,grpo_dis"],
      capture_output=True, text=True, timeout=1500, cwd=_REPO,
      env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.ref
def test_tiny_paper_sweep_runs_then_skips(tmp_path, pytestconfig):
  ckpt = tmp_path / "tiny_smollm2"
  _tiny_checkpoint(smollm2_checkpoint.converted_dir(pytestconfig), str(ckpt))
  overrides = {**_TINY, **_SHORT, "model.init_from": str(ckpt),
               "tokenizer.path": str(ckpt)}
  config = tmp_path / "tiny_paper.py"
  config.write_text(textwrap.dedent(f"""
      from configs import paper_smollm2

      def get_config():
        config = paper_smollm2.get_config()
        config.update_from_flattened_dict({overrides!r})
        return config

      get_sweep = paper_smollm2.get_sweep
      """))
  workdir = tmp_path / "sweep"
  first = _sweep(config, workdir)
  tails = {n: (workdir / n / "log.txt").read_text()[-3000:]
           for n in ("sao", "grpo_dis") if (workdir / n / "log.txt").exists()}
  assert first.returncode == 0, (first.stderr[-3000:], tails)
  for name, warmup in (("sao", 1), ("grpo_dis", 0)):
    summary = json.loads((workdir / name / "summary.json").read_text())
    assert summary["steps"] == warmup + 2, summary
    assert 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["episodes_consumed_twice"] == 0
  second = _sweep(config, workdir)
  assert second.returncode == 0, second.stderr[-3000:]
  assert second.stdout.strip().splitlines()[-1] == (
      f"sweep {workdir}: 0 finished, 2 skipped, 0 failed")
