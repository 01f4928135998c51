"""Tests for experiments/report.py on synthetic event files with known values."""

import importlib
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from sao_jax.train import metrics

_ROOT = pathlib.Path(__file__).absolute().parents[2]
_SCRIPT = _ROOT / "experiments" / "report.py"
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _import_report():
  """experiments/ is no package: its scripts import their siblings by name."""
  sys.path.insert(0, str(_SCRIPT.parent))
  try:
    return (importlib.import_module("report"),
            importlib.import_module("report_runs"))
  finally:
    sys.path.remove(str(_SCRIPT.parent))


report, report_runs = _import_report()


def _write_run(run_dir: pathlib.Path, *, evals: dict[int, float],
               logs: dict[int, dict[str, float]],
               summary: dict[str, float] | None = None) -> None:
  """Writes eval points, log points and end-of-run summary scalars."""
  with metrics.MetricWriter(str(run_dir / "tb")) as writer:
    steps = sorted(set(evals) | set(logs))
    for step in steps:
      scalars = dict(logs.get(step, {}))
      if step in evals:
        scalars["eval/accuracy"] = evals[step]
        scalars["eval/mean_length"] = 10.0
      writer.write_scalars(step, scalars)
    if summary:
      writer.write_scalars(steps[-1], {f"summary/{k}": v
                                       for k, v in summary.items()})


def _logs(steps, **series) -> dict[int, dict[str, float]]:
  return {s: {tag.replace("__", "/"): values[i]
              for tag, values in series.items()}
          for i, s in enumerate(steps)}


@pytest.fixture(name="sweep")
def fixture_sweep(tmp_path: pathlib.Path) -> pathlib.Path:
  """A sweep dir `cmp` with 2 SAO seeds, 2 GRPO seeds and an sft_cache dir."""
  sweep = tmp_path / "cmp"
  # SAO seed 0: accuracy 0.4, 0.6, 0.85, 0.7; the step-20 eval has no tokens
  # value: interpolated between (16, 1700) and (24, 2500) -> 2100.
  _write_run(
      sweep / "sao_seed0",
      evals={0: 0.4, 10: 0.6, 20: 0.85, 30: 0.7},
      logs=_logs([8, 16, 24, 30],
                 tokens__generated_total=[800, 1700, 2500, 3100],
                 policy__accept_frac=[0.9, 0.7, 0.95, 0.8],
                 policy__entropy=[1.2, 1.0, 0.8, 0.5],
                 policy__loss=[0.5, 0.4, 0.3, 0.2],
                 critic__explained_variance=[0.1, 0.2, 0.4, 0.6],
                 reward__mean=[0.1, 0.3, 0.5, 0.6],
                 staleness__mean=[1.0, 2.0, 3.0, 2.0]),
      summary={"wall_s": 123.0, "accuracy_after": 0.7})
  # SAO seed 1: reaches 0.8 at step 10 -> tokens 1000 (between 800 and 1600).
  _write_run(
      sweep / "sao_seed1",
      evals={0: 0.5, 10: 0.8, 20: 0.9, 30: 0.9},
      logs=_logs([8, 16, 24, 30],
                 tokens__generated_total=[800, 1600, 2400, 3000],
                 policy__accept_frac=[0.6, 0.9, 0.9, 0.9],
                 policy__entropy=[1.0, 0.9, 0.8, 0.7],
                 policy__loss=[0.5, 0.4, 0.3, 0.2],
                 critic__explained_variance=[0.5, 0.5, 0.5, 0.8],
                 reward__mean=[0.2, 0.4, 0.6, 0.7],
                 staleness__mean=[1.0, 1.0, 1.0, 1.0]),
      summary={"wall_s": 100.0, "staleness_mean": 1.5})
  # GRPO seed 0: NaN loss and accuracy 0.5 -> 0.6 -> 0.2: collapsed. No critic.
  _write_run(
      sweep / "grpo_seed0",
      evals={0: 0.5, 10: 0.6, 20: 0.2},
      logs=_logs([10, 20],
                 tokens__generated_total=[1000, 2000],
                 policy__clip_frac=[0.1, 0.25],
                 policy__entropy=[0.9, 0.1],
                 policy__loss=[0.3, float("nan")],
                 reward__mean=[0.3, 0.1],
                 staleness__mean=[4.0, 4.0]))
  # GRPO seed 1: stable, never reaches the target.
  _write_run(
      sweep / "grpo_seed1",
      evals={0: 0.5, 10: 0.55, 20: 0.52},
      logs=_logs([10, 20],
                 tokens__generated_total=[1000, 2000],
                 policy__clip_frac=[0.05, 0.04],
                 policy__entropy=[0.9, 0.8],
                 policy__loss=[0.3, 0.2],
                 reward__mean=[0.3, 0.35],
                 staleness__mean=[0.0, 2.0]))
  (sweep / "sft_cache").mkdir()
  (sweep / "sft_cache" / "params.msgpack").write_bytes(b"x")
  return sweep


def _rows_by_label(directory: pathlib.Path, **kwargs) -> dict:
  runs = report_runs.load_runs([str(directory)])
  return {r.label: report_runs.summarize(r, 0.8, **kwargs) for r in runs}


def _cells(markdown: str, first_cell: str) -> list[str]:
  """The cells of the table row whose first cell is `first_cell`."""
  for line in markdown.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if cells and cells[0] == first_cell:
      return cells
  raise AssertionError(f"no row {first_cell!r} in:\n{markdown}")


def test_find_runs_ignores_subdirs_without_tb(sweep):
  labels = [label for label, _ in report_runs.find_runs(str(sweep))]
  assert labels == ["cmp/grpo_seed0", "cmp/grpo_seed1", "cmp/sao_seed0",
                    "cmp/sao_seed1"]
  assert report_runs.find_runs(str(sweep / "sao_seed0"))[0][0] == "sao_seed0"


def test_summary_numbers(sweep):
  rows = _rows_by_label(sweep)
  sao0 = rows["cmp/sao_seed0"]
  assert sao0["final_acc"] == pytest.approx(0.7, abs=1e-6)
  assert sao0["best_acc"] == pytest.approx(0.85, abs=1e-6)
  assert sao0["initial_acc"] == pytest.approx(0.4, abs=1e-6)
  assert sao0["step_to_target"] == 20
  assert sao0["tokens_to_target"] == 2100.0  # Interpolated in step.
  assert sao0["total_tokens"] == 3100.0
  assert sao0["collapsed"] is False and sao0["collapse_reason"] == ""
  assert sao0["clip_reject_kind"] == "reject"
  assert sao0["max_clip_reject"] == pytest.approx(0.3, abs=1e-6)
  assert sao0["final_entropy"] == pytest.approx(0.5, abs=1e-6)
  assert sao0["final_ev"] == pytest.approx((0.2 + 0.4 + 0.6) / 3, abs=1e-6)
  assert sao0["mean_staleness"] == pytest.approx(2.0)  # Logged mean.
  assert sao0["wall_s"] == 123.0

  sao1 = rows["cmp/sao_seed1"]
  assert sao1["tokens_to_target"] == 1000.0
  assert sao1["max_clip_reject"] == pytest.approx(0.4, abs=1e-6)
  assert sao1["final_ev"] == pytest.approx(0.6, abs=1e-6)
  assert sao1["mean_staleness"] == 1.5  # summary/staleness_mean wins.

  grpo0 = rows["cmp/grpo_seed0"]
  assert grpo0["reached_target"] is False and grpo0["tokens_to_target"] is None
  assert grpo0["collapsed"] is True
  assert grpo0["collapse_reason"] == (
      "non-finite loss, final<0.5×best, final<initial−0.1")
  assert grpo0["clip_reject_kind"] == "clip"
  assert grpo0["max_clip_reject"] == pytest.approx(0.25, abs=1e-6)
  assert grpo0["final_ev"] is None and grpo0["wall_s"] is None

  grpo1 = rows["cmp/grpo_seed1"]
  assert grpo1["collapsed"] is False
  assert grpo1["max_clip_reject"] == pytest.approx(0.05, abs=1e-6)
  assert grpo1["mean_staleness"] == pytest.approx(1.0)


def test_collapse_thresholds_are_parameters(sweep):
  # GRPO seed 1: final 0.52, best 0.55 -> collapsed once collapse_frac=0.95.
  rows = _rows_by_label(sweep, collapse_frac=0.95, collapse_drop=0.1)
  assert rows["cmp/grpo_seed1"]["collapse_reason"] == "final<0.95×best"
  assert rows["cmp/sao_seed1"]["collapsed"] is False
  # GRPO seed 0: final 0.2, initial 0.5: a drop of 0.3.
  rows = _rows_by_label(sweep, collapse_frac=0.0, collapse_drop=0.35)
  assert rows["cmp/grpo_seed0"]["collapse_reason"] == "non-finite loss"
  rows = _rows_by_label(sweep, collapse_frac=0.0, collapse_drop=0.25)
  assert rows["cmp/grpo_seed0"]["collapse_reason"] == (
      "non-finite loss, final<initial−0.25")


def test_seed_group():
  assert report_runs.seed_group("cmp/sao_seed0") == "cmp/sao"
  assert report_runs.seed_group("cmp/sao_seed=12") == "cmp/sao"
  assert report_runs.seed_group("sweep/seed1") == "sweep"
  assert report_runs.seed_group("sweep/lr=1e-3_seed_2") == "sweep/lr=1e-3"
  assert report_runs.seed_group("sweep/seed-3_lr=1") == "sweep/lr=1"
  assert report_runs.seed_group("sweep/reseed1") == "sweep/reseed1"
  assert report_runs.seed_group("sao") == "sao"


def test_grouped_numbers(sweep):
  rows = list(_rows_by_label(sweep).values())
  groups = {g["group"]: g for g in report_runs.group_rows(rows)}
  assert sorted(groups) == ["cmp/grpo", "cmp/sao"]
  sao = groups["cmp/sao"]
  assert sao["n"] == 2 and sao["reached"] == 2
  mean, std = sao["final_acc"]
  assert mean == pytest.approx(0.8, abs=1e-6)
  assert std == pytest.approx(math.sqrt(0.02), abs=1e-6)  # Sample std.
  mean, std = sao["best_acc"]
  assert mean == pytest.approx(0.875, abs=1e-6)
  assert std == pytest.approx(0.05 / math.sqrt(2), abs=1e-6)
  assert sao["tokens_to_target"] == 1550.0
  assert sao["any_collapse"] is False
  grpo = groups["cmp/grpo"]
  assert grpo["reached"] == 0 and grpo["tokens_to_target"] is None
  assert grpo["final_acc"][0] == pytest.approx(0.36, abs=1e-6)
  assert grpo["final_acc"][1] == pytest.approx(0.32 / math.sqrt(2), abs=1e-6)
  assert grpo["any_collapse"] is True and grpo["collapsed_n"] == 1


def test_markdown_and_plots(sweep, tmp_path):
  out = tmp_path / "out"
  markdown = report.make_report([str(sweep)], str(out), target=0.8,
                                title="Synthetic")
  assert (out / "report.md").read_text() == markdown
  assert markdown.startswith("# Synthetic\n")
  assert _cells(markdown, "run") == report.RUN_COLUMNS
  assert _cells(markdown, "cmp/sao_seed0") == [
      "cmp/sao_seed0", "0.700", "0.850", "0.400", "2,100", "3,100", "no",
      "0.300 (reject)", "0.500", "0.400", "2.00", "123"]
  assert _cells(markdown, "cmp/grpo_seed0") == [
      "cmp/grpo_seed0", "0.200", "0.600", "0.500", "—", "2,000",
      "yes (non-finite loss, final<0.5×best, final<initial−0.1)",
      "0.250 (clip)", "0.100", "—", "4.00", "—"]
  assert _cells(markdown, "cmp/sao") == [
      "cmp/sao", "2", "0.800 ± 0.141", "0.875 ± 0.035", "1,550",
      "2/2 reached", "no"]
  assert _cells(markdown, "cmp/grpo") == [
      "cmp/grpo", "2", "0.360 ± 0.226", "0.575 ± 0.035", "—", "0/2 reached",
      "yes (1/2)"]
  assert "final accuracy < 0.5 × best" in markdown
  assert "ddof=1" in markdown
  expected = ["accuracy_vs_tokens.png", "clip_reject_vs_tokens.png",
              "entropy_vs_tokens.png", "reward_vs_tokens.png",
              "staleness_vs_step.png"]
  assert sorted(p.name for p in out.glob("*.png")) == expected
  for name in expected:
    data = (out / name).read_bytes()
    assert len(data) > 1000 and data[:8] == _PNG_SIGNATURE, name
    assert f"]({name})" in markdown
  curves = json.loads((out / "curves.json").read_text())
  assert sorted(curves) == ["cmp/grpo_seed0", "cmp/grpo_seed1",
                            "cmp/sao_seed0", "cmp/sao_seed1"]
  acc = curves["cmp/sao_seed0"]["eval/accuracy"]
  assert [s for s, _ in acc] == [0, 10, 20, 30]
  assert [v for _, v in acc] == pytest.approx([0.4, 0.6, 0.85, 0.7])  # f32.
  loss = curves["cmp/grpo_seed0"]["policy/loss"]
  assert loss[0][1] == pytest.approx(0.3) and loss[1] == [20, None]
  assert "policy/accept_frac" not in curves["cmp/grpo_seed0"]


def test_run_without_tags(tmp_path):
  run = tmp_path / "empty_run"
  metrics.MetricWriter(str(run / "tb")).close()  # Only the file header.
  out = tmp_path / "out"
  markdown = report.make_report([str(run)], str(out))
  assert _cells(markdown, "empty_run") == ["empty_run"] + ["—"] * 11
  assert "## Plots" not in markdown and "Seeds aggregated" not in markdown
  assert not list(out.glob("*.png"))
  row = report_runs.summarize(report_runs.load_run(str(run)))
  assert row["collapsed"] is None and row["reached_target"] is False


def test_resumed_run_newest_file_wins(tmp_path):
  run = tmp_path / "resumed"
  with metrics.MetricWriter(str(run / "tb")) as w:
    w.write_scalars(0, {"eval/accuracy": 0.25})
    w.write_scalars(10, {"eval/accuracy": 0.5, "tokens/generated_total": 100})
  with metrics.MetricWriter(str(run / "tb")) as w:  # Resumed from step 5.
    w.write_scalars(10, {"eval/accuracy": 0.75, "tokens/generated_total": 90})
  r = report_runs.load_run(str(run))
  steps, values = r.series("eval/accuracy")
  assert steps.tolist() == [0, 10] and values.tolist() == [0.25, 0.75]
  row = report_runs.summarize(r, target=0.7)
  assert row["tokens_to_target"] == 90.0 and row["best_acc"] == 0.75


def _cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(_SCRIPT), *args], cwd=_ROOT,
                        capture_output=True, text=True, timeout=300,
                        check=False, env={**os.environ, "MPLBACKEND": "Agg"})


def test_cli_writes_report_and_prints_it(sweep, tmp_path):
  out = tmp_path / "cli_out"
  proc = _cli(str(sweep), f"--out={out}", "--target=0.85", "--title=CLI")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout == (out / "report.md").read_text()
  # With target 0.85 only sao_seed0 (0.85 at step 20) and sao_seed1 (0.9 at
  # step 20: 1600 + 800 * 4/8 = 2000 tokens) reach it.
  assert _cells(proc.stdout, "cmp/sao_seed1")[4] == "2,000"
  assert _cells(proc.stdout, "cmp/sao")[4:6] == ["2,050", "2/2 reached"]
  assert (out / "accuracy_vs_tokens.png").read_bytes()[:8] == _PNG_SIGNATURE


def test_cli_missing_dir_fails_clearly(sweep, tmp_path):
  missing = tmp_path / "no_such_sweep"
  proc = _cli(str(sweep), str(missing), f"--out={tmp_path / 'o'}")
  assert proc.returncode != 0
  assert f"no such directory: {missing}" in proc.stderr
  assert not (tmp_path / "o" / "report.md").exists()
  not_a_run = tmp_path / "plain"
  not_a_run.mkdir()
  proc = _cli(str(not_a_run), f"--out={tmp_path / 'o'}")
  assert proc.returncode != 0
  assert "neither a run dir" in proc.stderr


def test_adaptation_after_style_switches(tmp_path):
  run_dir = tmp_path / "online" / "sao"
  # Version = step; reward 0.9 before the switch at 10, two stale batches
  # still scored under the old style, the dip, then recovery at version 16.
  rewards = {5: 0.9, 7: 0.9, 9: 0.9, 10: 0.9, 11: 0.9, 12: 0.1, 14: 0.5,
             16: 0.75, 18: 0.9, 30: 0.2}
  with metrics.MetricWriter(str(run_dir / "tb")) as w:
    for step, r in rewards.items():
      w.write_scalars(step, {"reward/mean": r, "policy_version": step})
  run = report_runs.load_run(str(run_dir), "online/sao")
  rows = report_runs.adaptation(run, [10, 30, 50], recover_frac=0.8, window=20)
  first, second, third = rows
  assert first["before"] == pytest.approx(0.9)
  assert first["dip"] == pytest.approx(0.1)
  assert first["versions_to_recover"] == 6.0  # 16 - 10: 0.75 >= 0.72.
  # Before 30: versions 10..29 -> mean of 0.9, 0.9, 0.1, 0.5, 0.75, 0.9.
  assert second["before"] == pytest.approx(np.mean([0.9, 0.9, 0.1, 0.5, 0.75,
                                                     0.9]))
  assert second["dip"] == pytest.approx(0.2)
  assert second["versions_to_recover"] is None  # Never recovered.
  assert third["before"] is None  # Nothing logged around version 50.
  # The reward before version 30 is 0 after a second switch at 30 with
  # all-zero rewards: nothing to recover, not "recovered at once".
  zero = report_runs.RunData("z", "", {
      "reward/mean": (np.arange(0, 40, 2), np.zeros(20)),
      "policy_version": (np.arange(0, 40, 2), np.arange(0, 40, 2) * 1.0)})
  (row,) = report_runs.adaptation(zero, [30])
  assert row["before"] == 0.0 and row["versions_to_recover"] is None
  assert "n/a (reward 0 before)" in report.adaptation_table([row])
  out = tmp_path / "out"
  markdown = report.make_report([str(tmp_path / "online")], str(out),
                                switches=[10, 30])
  assert "| online/sao | 10 | 0.900 | 0.100 | 6 |" in markdown
  assert "| online/sao | 30 | 0.675 | 0.200 | — |" in markdown
  assert (out / "reward_vs_version.png").read_bytes()[:8] == _PNG_SIGNATURE


def test_points_sorted_naturally(tmp_path):
  for point in ("eta16", "eta4", "eta0", "eta1"):
    metrics.MetricWriter(str(tmp_path / "st" / point / "tb")).close()
  labels = [label for label, _ in report_runs.find_runs(str(tmp_path / "st"))]
  assert labels == ["st/eta0", "st/eta1", "st/eta4", "st/eta16"]
