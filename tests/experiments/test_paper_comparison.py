"""experiments/paper_comparison.py on synthetic event files with known values."""

import importlib
import json
import math
import pathlib
import sys

import pytest

from sao_jax.train import evaluate
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
  # No run kept per-problem scores: every gap's error is the independent one.
  assert ("SE of a gap: independent binomial sqrt(se_a² + se_b²) at grpo v0, "
          "v2, v4 (runs without per-problem scores: grpo, sao).") in text
  assert [g["se_kind"] for g in arms["grpo"]["gaps"]] == ["independent"] * 3
  assert "Several seeds" not in text


def test_gap_within_errors_is_not_flagged():
  a = {"curve": [{"step": 10, "accuracy": 0.55, "se": 0.03}]}
  b = {"curve": [{"step": 10, "accuracy": 0.50, "se": 0.03}]}
  (g,) = pc.gaps(a, b)
  assert g["gap"] == pytest.approx(0.05)
  assert g["se"] == pytest.approx(0.03 * math.sqrt(2))
  assert not g["beyond_2se"] and not g["beyond"]  # 0.05 < 2 x 0.0424.
  assert g["se_seeds"] is None  # No seeds.
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


# Per-problem scores (4 problems) of two arms x two seeds at versions 0 and 2.
# Differences grpo - sao: v0 s0 [0,0,1,0], s1 [0,1,0,0]; v2 both [1,1,1,0].
_SCORES = {
    "sao_s0": {0: [1, 1, 0, 0], 2: [0, 0, 0, 1]},
    "sao_s1": {0: [1, 0, 0, 0], 2: [0, 0, 0, 0]},
    "grpo_s0": {0: [1, 1, 1, 0], 2: [1, 1, 1, 1]},
    "grpo_s1": {0: [1, 1, 0, 0], 2: [1, 1, 1, 0]},
}


@pytest.fixture(name="seeds")
def fixture_seeds(tmp_path):
  sweep = tmp_path / "seeds"
  for point, by_version in _SCORES.items():
    with metrics.MetricWriter(str(sweep / point / "tb")) as w:
      for v, scores in by_version.items():
        w.write_scalars(v, {"eval/accuracy": sum(scores) / 4,
                            "eval/num_problems": 4.0, "policy_version": v})
        evaluate.write_scores(str(sweep / point / "eval"), v, v, scores)
  return sweep


def test_seeds_are_grouped_with_paired_errors(seeds, tmp_path):
  out = tmp_path / "out"
  text = pc.make(str(seeds), str(out))
  arms = json.loads((out / "curves.json").read_text())
  assert sorted(arms) == ["grpo", "sao"]
  sao = arms["sao"]
  assert sao["seeds"] == [0, 1]
  # Means over seeds (0.5, 0.25) and (0.25, 0); SD of two values 0.25 apart.
  assert [p["accuracy"] for p in sao["curve"]] == pytest.approx([.375, .125])
  assert [p["sd"] for p in sao["curve"]] == pytest.approx(
      [.25 / math.sqrt(2)] * 2)
  assert [p["seeds"] for p in sao["curve"]] == [2, 2]
  # Binomial SE of a mean over seeds: sqrt(.5*.5/4 + .25*.75/4) / 2 at v0.
  assert sao["curve"][0]["se"] == pytest.approx(math.sqrt(.109375) / 2)
  # Paired, clustered by problem: each problem's difference averaged over
  # the two seeds is [0, .5, .5, 0] at v0 (mean 0.25, squared deviations
  # 0.25: SE = sqrt(.25 / 3 / 4) = 0.144) and [1, 1, 1, 0] at v2 (mean 0.75,
  # 0.75: SE = sqrt(.75 / 3 / 4) = 0.25): within 2 SE at v0, beyond at v2.
  g = arms["grpo"]["gaps"]
  assert [p["gap"] for p in g] == pytest.approx([.25, .75])
  assert [p["se"] for p in g] == pytest.approx(
      [math.sqrt(.25 / 12), math.sqrt(.75 / 12)])
  assert [p["se_kind"] for p in g] == ["paired"] * 2
  assert [p["beyond_2se"] for p in g] == [False, True]
  assert arms["sao"]["gaps"] is None  # The baseline.
  assert "| sao | 0.375 ± 0.177 (2) | 0.125 ± 0.177 (2) |" in text
  assert "| grpo | 0.625 ± 0.177 (2) | 0.875 ± 0.177 (2) |" in text
  # Both seeds' accuracy gaps are equal (.25, .25 at v0; .75, .75 at v2):
  # their seed SE is 0, which keeps v2's verdict.
  assert [p["se_seeds"] for p in g] == [0.0, 0.0]
  assert [p["seed_pairs"] for p in g] == [2, 2]
  assert [p["beyond"] for p in g] == [False, True]
  assert ("| grpo | +25.0 ± 14.4 / 0.0 (2) | +75.0 ± 25.0 / 0.0 (2)* | no |"
          in text)
  assert ("SE of a gap: paired (the SE over problems of each problem's "
          "difference averaged over the seeds" in text)
  assert "at grpo v0, v2." in text and "independent" not in text


def test_a_run_without_scores_falls_back_to_independent_errors(seeds,
                                                               tmp_path):
  for f in (seeds / "grpo_s1" / "eval").iterdir():
    f.unlink()
  text = pc.make(str(seeds), str(tmp_path / "out"))
  g = json.loads((tmp_path / "out" / "curves.json").read_text())["grpo"]
  # Independent: hypot of the arms' binomial SEs of their means over seeds,
  # sqrt(.109375) / 2 each at v0 (23.4 points) and sqrt(.046875) / 2 each at
  # v2 (15.3 points).
  assert [p["se"] for p in g["gaps"]] == pytest.approx(
      [math.sqrt(.109375 / 2), math.sqrt(.046875 / 2)])
  assert [p["se_kind"] for p in g["gaps"]] == ["independent"] * 2
  assert ("| grpo | +25.0 ± 23.4 / 0.0 (2) | +75.0 ± 15.3 / 0.0 (2)* | no |"
          in text)
  assert ("SE of a gap: independent binomial sqrt(se_a² + se_b²) at grpo v0, "
          "v2 (runs without per-problem scores: grpo_s1).") in text
  assert "paired" not in text


def test_a_gap_the_seeds_disagree_on_is_not_flagged(tmp_path):
  # Three seeds, one eval of 4 problems, no per-problem scores: sao .25 in
  # each seed, grpo 1, .25, 1. The gap .5 is beyond 2 independent SEs
  # (hypot(sqrt(3 x .046875) / 3, sqrt(.046875) / 3) = .144), but its seed
  # differences .75, 0, .75 have SE .25 and t(2) = 4.303 makes that 1.08.
  for arm, accs in (("sao", (.25, .25, .25)), ("grpo", (1., .25, 1.))):
    for k, acc in enumerate(accs):
      with metrics.MetricWriter(str(tmp_path / "s" / f"{arm}_s{k}" / "tb")
                                ) as w:
        w.write_scalars(0, {"eval/accuracy": acc, "eval/num_problems": 4.0,
                            "policy_version": 0})
  text = pc.make(str(tmp_path / "s"), str(tmp_path / "out"))
  (g,) = json.loads((tmp_path / "out" / "curves.json").read_text()
                    )["grpo"]["gaps"]
  assert g["gap"] == pytest.approx(.5)
  assert g["se"] == pytest.approx(math.hypot(math.sqrt(3 * .046875) / 3,
                                             math.sqrt(.046875) / 3))
  assert g["beyond_2se"]
  assert g["se_seeds"] == pytest.approx(.25)
  assert (g["seed_pairs"], g["t_seeds"]) == (3, pytest.approx(4.3027, abs=1e-4))
  assert not g["beyond"]
  assert "| grpo | +50.0 ± 14.4 / 25.0 (3) | no |" in text


def test_diagnostics_by_window_of_policy_steps(tmp_path):
  # Two SAO seeds: a critic warm-up step (version 0), then versions 1-3.
  sweep = tmp_path / "diag"
  explained = {"sao_s0": [-2.0, -1.0, 0.0, 1.0], "sao_s1": [-4.0, -1.0, 2.0, 3.0]}
  for point, ev in explained.items():
    with metrics.MetricWriter(str(sweep / point / "tb")) as w:
      w.write_scalars(0, {"eval/accuracy": 0.5, "eval/num_problems": 4.0})
      for step, value in enumerate(ev, start=1):
        w.write_scalars(step, {"policy_version": step - 1,
                               "critic/explained_variance": value,
                               "policy/accept_frac": 1.0 - 0.01 * step})
  text = pc.make(str(sweep), str(tmp_path / "out"), window=2)
  diag = json.loads((tmp_path / "out" / "diagnostics.json").read_text())
  # Warm-up: mean(-2, -4); v1-2: the seeds' means -0.5 and 0.5; v3-4: 1, 3.
  assert diag["sao"]["expl. var."] == pytest.approx(
      {"warm-up": -3.0, "v1-2": 0.0, "v3-4": 2.0})
  # DIS-masked = 1 - accept_frac: steps 2-3 in v1-2, step 4 in v3-4.
  assert diag["sao"]["DIS-masked"] == pytest.approx(
      {"warm-up": 0.01, "v1-2": 0.025, "v3-4": 0.04})
  assert "adv. std" not in diag["sao"]  # Never logged.
  assert "| sao | warm-up | -3 | — | 0.01 | — |" in text
  assert "| sao | v3-4 | 2 | — | 0.04 | — |" in text
