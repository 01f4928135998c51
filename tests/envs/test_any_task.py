"""Any reasoning-gym task with one override (issue 18).

``python -m sao_jax.main --config=configs/reasoning_gym.py
  --config.env.dataset=NAME`` validates, derives its settings and runs to its
  summary on tasks of five kinds (tiny model, a few steps each).
"""

import json
import pathlib
import subprocess
import sys

import pytest

from sao_jax.envs import task_sizing

REPO = pathlib.Path(__file__).resolve().parents[2]

FIVE_KINDS = ("chain_sum", "letter_counting", "spell_backward", "syllogism",
              "maze")
# Tiny model and budget, no critic-only step (a program fewer to compile);
# nothing about the task.
TINY = {"model.hidden_size": 32, "model.intermediate_size": 64,
        "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 1,
        "model.head_dim": 16, "tokenizer.corpus_size": 100, "env.size": 256,
        "env.eval_size": 8, "sampler.batch_size": 8, "train.batch_size": 8,
        "train.sft_steps": 4, "train.sft_batch_size": 8,
        "rl.critic_warmup_steps": 0, "train.num_steps": 2,
        "train.eval_every": 0, "train.checkpoint_every": 0}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("dataset", FIVE_KINDS)
def test_one_override_switches_the_task(tmp_path, dataset):
  args = [sys.executable, "-m", "sao_jax.main",
          "--config=configs/reasoning_gym.py", f"--workdir={tmp_path}",
          f"--config.env.dataset={dataset}"]
  args += [f"--config.{k}={v}" for k, v in TINY.items()]
  done = subprocess.run(args, cwd=REPO, capture_output=True, text=True,
                        timeout=1800, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["steps"] == 2 and summary["eval_problems"] == 8
  assert 0.0 <= summary["accuracy_after"] <= 1.0
  log = done.stderr
  assert f"Task {dataset!r}" in log
  for key in ("model.vocab_size", *task_sizing.LENGTH_KEYS):
    assert f"config.{key} = " in log and "(derived)" in log, key
