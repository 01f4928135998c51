"""experiments/paper_comparison.py on synthetic event files with known values."""

import importlib
import json
import math
import pathlib
import sys

import pytest

from sao_jax.train import metrics

_EXPERIMENTS = pathlib.Path(__file__).absolute().parents[2] / "experiments"


def _import():
  sys.path.insert(0, str(_EXPERIMENTS))
  try:
    return importlib.import_module("paper_comparison")
  finally:
    sys.path.remove(str(_EXPERIMENTS))


pc = _import()


def _write(run_dir, evals, per_step, summary):
  """evals {trainer step: accuracy}; per_step {step: {tag: value}}."""
  with metrics.MetricWriter(str(run_dir / "tb")) as w:
    for step in sorted(set(evals) | set(per_step)):
      scalars = dict(per_step.get(step, {}))
      if step in evals:
        scalars.update({"eval/accuracy": evals[step],
                        "eval/num_problems": 100.0})
      w.write_scalars(step, scalars)
    w.write_scalars(max(per_step), {f"summary/{k}": v
                                    for k, v in summary.items()})


@pytest.fixture(name="sweep")
def fixture_sweep(tmp_path):
  sweep = tmp_path / "paper"
  # SAO: 2 critic warm-up steps (policy version 0), then a version a step;
  # evals at versions 0, 2, 4 = trainer steps 0, 4, 6.
  _write(sweep / "sao", {0: 0.5, 4: 0.5, 6: 0.9},
         {s: {"policy_version": max(0, s - 2), "policy/accept_frac": 0.9,
              "policy/reject_low_frac": 0.05, "staleness/mean": 1.0}
          for s in range(1, 7)},
         {"staleness_mean": 1.0, "episodes_watermark": 32, "wall_s": 600})
  # GRPO: no warm-up; evals at versions 0, 2, 4; ahead at 2, behind at 4.
  _write(sweep / "grpo", {0: 0.5, 2: 0.8, 4: 0.6},
         {s: {"policy_version": s, "policy/clip_frac": 0.2,
              "staleness/mean": 2.0} for s in range(1, 5)},
         {"episodes_watermark": 32, "wall_s": 300})
  return sweep


def test_curves_by_policy_step_with_binomial_errors(sweep, tmp_path):
  out = tmp_path / "out"
  text = pc.make(str(sweep), str(out))
  arms = json.loads((out / "curves.json").read_text())
  sao = arms["sao"]
  assert [p["step"] for p in sao["curve"]] == [0, 2, 4]  # Versions.
  assert [p["accuracy"] for p in sao["curve"]] == pytest.approx([.5, .5, .9])
  assert sao["curve"][2]["se"] == pytest.approx(math.sqrt(.9 * .1 / 100))
  assert sao["masked_frac"] == pytest.approx(0.1)
  assert sao["masked_kind"] == "DIS-masked"
  assert sao["staleness"] == 1.0 and sao["rollouts"] == 32
  grpo = arms["grpo"]
  assert grpo["masked_frac"] == pytest.approx(0.2)
  assert grpo["masked_kind"] == "PPO-clipped"
  assert grpo["staleness"] == pytest.approx(2.0)  # The logged mean.
  # Gap at v2: 0.8 - 0.5 = +30 points, SE hypot(4.0, 5.0) = 6.4: beyond 2 SE;
  # at v4: 0.6 - 0.9 = -30 points, SE hypot(4.9, 3.0) = 5.7; crossed at v4.
  assert "| grpo | +0.0 ± 7.1 | +30.0 ± 6.4* | -30.0 ± 5.7* | v4 |" in text
  assert "| sao | 0.500 ± 0.050 | 0.500 ± 0.050 | 0.900 ± 0.030 |" in text
  assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (out / "comparison.md").read_text() == text


def test_gap_within_errors_is_not_flagged():
  a = {"curve": [{"step": 10, "accuracy": 0.55, "se": 0.03}]}
  b = {"curve": [{"step": 10, "accuracy": 0.50, "se": 0.03}]}
  (g,) = pc.gaps(a, b)
  assert g["gap"] == pytest.approx(0.05)
  assert g["se"] == pytest.approx(0.03 * math.sqrt(2))
  assert not g["beyond_2se"]  # 0.05 < 2 x 0.0424.
  assert pc.crossings([{"step": 0, "gap": 0.0}, {"step": 10, "gap": 0.1},
                       {"step": 20, "gap": -0.1}]) == [20]


def test_a_sweep_without_evals_is_refused(tmp_path):
  run = tmp_path / "empty" / "sao"
  with metrics.MetricWriter(str(run / "tb")) as w:
    w.write_scalars(1, {"reward/mean": 0.5})
  with pytest.raises(FileNotFoundError, match="logged eval/accuracy"):
    pc.make(str(tmp_path / "empty"), str(tmp_path / "out"))


def test_command_line_writes_the_same_table(sweep, tmp_path, capsys):
  pc.main([str(sweep), "--out", str(tmp_path / "cli"), "--baseline=grpo"])
  text = (tmp_path / "cli" / "comparison.md").read_text()
  assert capsys.readouterr().out.strip() == text.strip()
  assert "Gap to grpo" in text
  assert "| sao | +0.0 ± 7.1 | -30.0 ± 6.4* | +30.0 ± 5.7* | v4 |" in text
