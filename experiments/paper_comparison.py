r"""The paper's main comparison as a table, curves and a plot (issues 29, 40).

Reads a sweep of `configs/paper_smollm2.py` or `configs/paper_smollm2_seeds.py`
(every point's TensorBoard events, through ``report_runs``, and the per-problem
held-out scores a run keeps in ``<point>/eval/v<version>.json``; it never
re-runs anything) and writes to ``--out``:

- ``comparison.md``: per arm, held-out accuracy at every eval (by policy
  step: the policy version it evaluated) with its error, the mean DIS-masked
  fraction (1 - ``policy/accept_frac``; the PPO clip fraction for an arm
  without DIS), the mean staleness, rollouts and wall time; then each arm's
  gap to ``--baseline`` at every eval step, whether it exceeds twice its
  standard error, and where the curves cross;
- ``curves.json``: the raw points per arm (step, accuracy, standard error,
  seed-to-seed SD, seeds) and its gaps to the baseline;
- ``accuracy.png``: the curves with their error bars;
- a diagnostics table (in ``comparison.md``, and ``diagnostics.json``): per
  arm and window of ``--window`` policy steps, the critic's explained
  variance, advantage std, DIS-masked fraction, |Δlogp|, staleness, reward
  and entropy (``paper_diagnostics``).

Seeds: points named ``<arm>_s<k>`` are seed k of ``<arm>``; an arm's accuracy
at an eval is the mean over its seeds, shown ± the seed-to-seed standard
deviation with the number of seeds. A point without the suffix is an arm of
one seed, shown ± the binomial standard error sqrt(p (1 - p) / n) over its n
held-out problems (the table of a one-seed sweep is as it was before seeds).

A gap's standard error is **paired** where every seed of both arms kept its
per-problem scores at that eval (all arms answer the same problems): seeds
matched by k, each problem's difference averaged over the seeds, and the
standard error of the mean of those n values (clustered by problem: a
problem's differences over the seeds share its difficulty, so pooling all
(seed, problem) pairs as independent would understate the error; with one
seed it is the SE of the mean per-problem difference). Elsewhere (a run
without ``eval/`` files) it falls back to the independent
sqrt(se_a^2 + se_b^2) of the arms' binomial errors (of a mean over seeds:
sqrt(sum p_i (1 - p_i) / n_i) / seeds), which is conservative; the
table's note names the evals and runs each error comes from.

Both errors hold the problems' spread at fixed seeds, not what another seed
changes (the seeds of one arm can differ by more than the arms' gaps). With
two or more seeds of both arms a gap also gets its seed SE: the SE of the
per-seed accuracy differences (seeds matched by k), and a gap is flagged only
beyond 2 SE and beyond Student's t(97.5%, pairs - 1) seed SEs.

  python experiments/paper_comparison.py runs/paper_smollm2_seeds \
      --out=experiments/results/paper_smollm2_seeds
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import glob
import json
import math
import os
import re
from typing import Any

import numpy as np
import paper_diagnostics
import report_runs


def standard_error(p: float, n: int) -> float:
  """Binomial standard error of an accuracy p over n problems."""
  return math.sqrt(max(p * (1.0 - p), 0.0) / n)


def _mean(run: report_runs.RunData, tag: str) -> float | None:
  return float(np.mean(run.series(tag)[1])) if run.has(tag) else None


def policy_steps(run: report_runs.RunData, steps: np.ndarray) -> np.ndarray:
  """The policy version at trainer ``steps`` (SAO's critic warm-up steps do
  not update the policy, so its evals at every 10 policy steps fall on other
  trainer steps than GRPO's); 0 before the first logged version."""
  if not run.has("policy_version"):
    return steps
  s, v = run.series("policy_version")
  return np.rint(np.interp(steps, np.concatenate([[0], s]),
                           np.concatenate([[0], v]))).astype(np.int64)


def eval_scores(run_dir: str) -> dict[int, np.ndarray]:
  """The per-problem held-out scores a run kept: ``{version: scores}`` ({} for
  a run without ``eval/`` files)."""
  out = {}
  for path in glob.glob(os.path.join(run_dir, "eval", "v*.json")):
    with open(path) as f:
      kept = json.load(f)
    out[int(kept["version"])] = np.asarray(kept["scores"], np.float64)
  return out


def run_summary(run: report_runs.RunData, problems: int) -> dict[str, Any]:
  """One run's curve and figures (None where the run lacks a tag)."""
  steps, acc = run.series("eval/accuracy")
  steps = policy_steps(run, steps)
  ns = run.series("eval/num_problems")[1]
  n = [int(ns[i]) if i < ns.size else problems for i in range(acc.size)]
  masked, kind = None, None
  if run.has("policy/accept_frac") and run.has("policy/reject_low_frac"):
    masked, kind = 1.0 - _mean(run, "policy/accept_frac"), "DIS-masked"
  if run.has("policy/clip_frac"):
    masked, kind = _mean(run, "policy/clip_frac"), "PPO-clipped"
  return {
      "arm": run.label.rsplit("/", 1)[-1],
      "curve": [{"step": int(s), "accuracy": float(a), "problems": k,
                 "se": standard_error(float(a), k)}
                for s, a, k in zip(steps, acc, n)],
      "masked_frac": masked, "masked_kind": kind,
      "staleness": run.last("summary/staleness_mean") or _mean(
          run, "staleness/mean"),
      "rollouts": run.last("summary/episodes_watermark"),
      "wall_s": run.last("summary/wall_s"),
      "_scores": eval_scores(run.path),
  }


def _seed_of(point: str) -> tuple[str, int | None]:
  """``('sao', 2)`` for point ``sao_s2``; ``(point, None)`` without a seed."""
  m = re.fullmatch(r"(.+)_s(\d+)", point)
  return (m.group(1), int(m.group(2))) if m else (point, None)


def _mean_of(values: Sequence[float | None]) -> float | None:
  known = [v for v in values if v is not None]
  return float(np.mean(known)) if known else None


def arm_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """An arm from its seeds' ``run_summary``s: at each eval step the mean
  accuracy over the seeds that have it, their SD (None for one), the
  binomial SE of that mean, and the seeds."""
  if len(runs) == 1 and _seed_of(runs[0]["arm"])[1] is None:
    return {**runs[0], "seeds": [None],
            "curve": [{**p, "sd": None, "seeds": 1, "by_seed": {}}
                      for p in runs[0]["curve"]],
            "_scores": {None: runs[0]["_scores"]}}
  seeds = [_seed_of(r["arm"])[1] for r in runs]
  at = [{p["step"]: p for p in r["curve"]} for r in runs]
  curve = []
  for step in sorted({s for a in at for s in a}):
    pts = [a[step] for a in at if step in a]
    by_seed = {k: a[step]["accuracy"] for k, a in zip(seeds, at) if step in a}
    acc = np.array([p["accuracy"] for p in pts])
    curve.append({
        "step": step, "accuracy": float(acc.mean()),
        "problems": pts[0]["problems"],
        "se": math.sqrt(sum(p["se"] ** 2 for p in pts)) / len(pts),
        "sd": float(acc.std(ddof=1)) if len(pts) > 1 else None,
        "seeds": len(pts), "by_seed": by_seed})
  kinds = {r["masked_kind"] for r in runs if r["masked_kind"]}
  return {
      "arm": _seed_of(runs[0]["arm"])[0], "seeds": seeds, "curve": curve,
      "masked_frac": _mean_of([r["masked_frac"] for r in runs]),
      "masked_kind": kinds.pop() if len(kinds) == 1 else None,
      "staleness": _mean_of([r["staleness"] for r in runs]),
      "rollouts": _mean_of([r["rollouts"] for r in runs]),
      "wall_s": _mean_of([r["wall_s"] for r in runs]),
      "_scores": {k: r["_scores"] for k, r in zip(seeds, runs)},
  }


def group_arms(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Groups ``run_summary``s of points ``<arm>_s<k>`` into arms (in order)."""
  by_arm: dict[str, list[dict[str, Any]]] = {}
  for r in runs:
    by_arm.setdefault(_seed_of(r["arm"])[0], []).append(r)
  return [arm_summary(rs) for rs in by_arm.values()]


def paired(arm: dict[str, Any], base: dict[str, Any], step: int
           ) -> tuple[float, float] | None:
  """(gap, SE) from per-problem differences at ``step``, seeds matched by
  k, each problem's differences averaged over the seeds (the SE is over
  problems); None unless every seed of both arms kept the same number of
  scores there."""
  a, b = arm.get("_scores", {}), base.get("_scores", {})
  if not a or set(a) != set(b):
    return None
  diffs = []
  for seed in sorted(a, key=lambda k: -1 if k is None else k):
    if step not in a[seed] or step not in b[seed] or (
        a[seed][step].size != b[seed][step].size):
      return None
    diffs.append(a[seed][step] - b[seed][step])
  # Clustered by problem: a problem's differences over the seeds are not
  # independent (its difficulty is shared), so each problem contributes its
  # mean difference over the seeds, and the SE is over the n problems.
  d = np.mean(diffs, axis=0)
  if d.size < 2:
    return None
  return float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))


def seed_gap(p: dict[str, Any], b: dict[str, Any]
             ) -> tuple[float, int, float] | None:
  """(SE, seed pairs, t) of a gap from seed-to-seed variation: the per-seed
  accuracy differences of seeds run for both arms (matched by k), the SE of
  their mean and Student's t at 97.5% for that many pairs; None under two
  pairs. The per-problem SE holds the problems' spread at fixed seeds; this
  one holds what a rerun with another seed changes."""
  common = sorted(set(p.get("by_seed", {})) & set(b.get("by_seed", {})))
  if len(common) < 2:
    return None
  d = np.array([p["by_seed"][k] - b["by_seed"][k] for k in common])
  # pylint: disable-next=g-import-not-at-top
  from scipy import stats
  return (float(d.std(ddof=1) / math.sqrt(d.size)), int(d.size),
          float(stats.t.ppf(0.975, d.size - 1)))


def gaps(arm: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]]:
  """arm - base at the eval steps both have, with the gap's standard error
  (paired where per-problem scores allow, else independent binomial) and,
  with two or more seeds of both, its seed-to-seed SE (``seed_gap``). A gap
  counts (``beyond``) only beyond 2 SE and, where seeds allow, beyond t
  seed-SEs too."""
  at = {p["step"]: p for p in base["curve"]}
  out = []
  for p in arm["curve"]:
    if p["step"] in at:
      b = at[p["step"]]
      pair = paired(arm, base, p["step"])
      if pair is not None:
        gap, se = pair
      else:
        gap, se = p["accuracy"] - b["accuracy"], math.hypot(p["se"], b["se"])
      seeds = seed_gap(p, b)
      se_seeds, pairs, t = seeds if seeds else (None, None, None)
      beyond_seeds = None if seeds is None else abs(gap) > t * se_seeds
      out.append({"step": p["step"], "gap": gap, "se": se,
                  "se_kind": "independent" if pair is None else "paired",
                  "beyond_2se": abs(gap) > 2 * se,
                  "se_seeds": se_seeds, "seed_pairs": pairs, "t_seeds": t,
                  "beyond": abs(gap) > 2 * se and beyond_seeds is not False})
  return out


def crossings(gap_points: Sequence[dict[str, Any]]) -> list[int]:
  """Policy steps at which the gap changes sign from the previous eval's."""
  signs = [(g["step"], np.sign(g["gap"])) for g in gap_points]
  return [s for (_, a), (s, b) in zip(signs, signs[1:])
          if a and b and a != b]


def _f(x: float | None, digits: int = 3) -> str:
  return "—" if x is None else f"{x:.{digits}f}"


_PAIRED = ("paired (the SE over problems of each problem's difference "
           "averaged over the seeds, seeds matched by k)")
_INDEPENDENT = "independent binomial sqrt(se_a² + se_b²)"


def _points_without_scores(arms: Sequence[dict[str, Any]]) -> list[str]:
  return [a["arm"] if k is None else f"{a['arm']}_s{k}"
          for a in arms for k, scores in a["_scores"].items() if not scores]


def _se_note(rows: Sequence[tuple[str, list[dict[str, Any]]]],
             arms: Sequence[dict[str, Any]]) -> list[str]:
  """Which error each gap has (paired or the independent fallback)."""
  parts = []
  for kind, text in (("paired", _PAIRED), ("independent", _INDEPENDENT)):
    where = [f"{arm} " + ", ".join(f"v{g['step']}" for g in gs
                                  if g["se_kind"] == kind)
             for arm, gs in rows if any(g["se_kind"] == kind for g in gs)]
    if where:
      parts.append(f"{text} at {'; '.join(where)}")
  if not parts:
    return []
  missing = _points_without_scores(arms)
  tail = (f" (runs without per-problem scores: {', '.join(missing)})"
          if missing else "")
  return ["", "SE of a gap: " + "; ".join(parts) + tail + "."]


def _cell(p: dict[str, Any]) -> str:
  if p["seeds"] > 1:
    return f"{p['accuracy']:.3f} ± {p['sd']:.3f} ({p['seeds']})"
  return f"{p['accuracy']:.3f} ± {p['se']:.3f}"


def _gap_cell(g: dict[str, Any]) -> str:
  seeds = ("" if g["se_seeds"] is None else
           f" / {100 * g['se_seeds']:.1f} ({g['seed_pairs']})")
  return (f"{100 * g['gap']:+.1f} ± {100 * g['se']:.1f}{seeds}"
          + ("*" if g["beyond"] else ""))


def markdown(arms: Sequence[dict[str, Any]], baseline: str) -> str:
  """The comparison's tables."""
  steps = sorted({p["step"] for a in arms for p in a["curve"]})
  lines = ["| arm | " + " | ".join(f"v{s}" for s in steps) +
           " | masked / clipped | staleness | rollouts | wall |",
           "|---" * (len(steps) + 5) + "|"]
  for a in arms:
    at = {p["step"]: p for p in a["curve"]}
    cells = [_cell(at[s]) if s in at else "—" for s in steps]
    masked = (f"{a['masked_frac']:.4f} ({a['masked_kind']})"
              if a["masked_frac"] is not None else "—")
    wall = "—" if a["wall_s"] is None else f"{a['wall_s'] / 60:.0f} min"
    lines.append(f"| {a['arm']} | " + " | ".join(cells) + f" | {masked} | "
                 f"{_f(a['staleness'], 2)} | {_f(a['rollouts'], 0)} | "
                 f"{wall} |")
  if any(p["seeds"] > 1 for a in arms for p in a["curve"]):
    lines += ["", "Several seeds: mean accuracy over seeds ± their SD "
              "(seeds); one seed: accuracy ± binomial SE. Masked fraction, "
              "staleness, rollouts and wall time: means over seeds."]
  base = [a for a in arms if a["arm"] == baseline]
  if base:
    lines += ["", f"Gap to {baseline} (accuracy points ± SE; with seeds of "
              "both arms, / seed SE (pairs); * beyond 2 SE and, with seeds, "
              "beyond Student's t(97.5%) seed SEs):", "",
              "| arm | " + " | ".join(f"v{s}" for s in steps) +
              " | crosses at |", "|---" * (len(steps) + 2) + "|"]
    rows = []
    for a in arms:
      if a is base[0]:
        continue
      rows.append((a["arm"], gaps(a, base[0])))
      g = {p["step"]: p for p in rows[-1][1]}
      cells = [_gap_cell(g[s]) if s in g else "—" for s in steps]
      cross = crossings(list(g.values()))
      lines.append(f"| {a['arm']} | " + " | ".join(cells) + " | " +
                   (", ".join(f"v{s}" for s in cross) or "no") + " |")
    lines += _se_note(rows, arms)
  return "\n".join(lines) + "\n"


def plot(arms: Sequence[dict[str, Any]], path: str) -> None:
  """Accuracy vs policy step per arm, with seed-SD (one seed: SE) bars."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for a in arms:
    c = a["curve"]
    ax.errorbar([p["step"] for p in c], [p["accuracy"] for p in c],
                yerr=[p["se"] if p["sd"] is None else p["sd"] for p in c],
                capsize=3, marker="o", label=a["arm"])
  ax.set_xlabel("policy step")
  ax.set_ylabel("held-out accuracy")
  ax.set_title("bars: ± SD over seeds (one seed: ± binomial SE)",
               fontsize="medium")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def diagnostics(runs: Sequence[report_runs.RunData], window: int
                ) -> dict[str, dict[str, dict[int, float]]]:
  """``paper_diagnostics.arm_windows`` of each arm (points grouped by seed
  as ``group_arms`` does)."""
  by_arm: dict[str, list[report_runs.RunData]] = {}
  for r in runs:
    by_arm.setdefault(_seed_of(r.label.rsplit("/", 1)[-1])[0], []).append(r)
  return {arm: paper_diagnostics.arm_windows(rs, window)
          for arm, rs in by_arm.items()}


def make(directory: str, out: str, baseline: str = "sao",
         problems: int = 256, window: int = 10) -> str:
  """Writes comparison.md (with the diagnostics by ``window`` policy
  steps), curves.json, diagnostics.json and accuracy.png; returns the md."""
  runs = [r for r in report_runs.load_runs([directory])
          if r.has("eval/accuracy")]
  arms = group_arms([run_summary(r, problems) for r in runs])
  if not arms:
    raise FileNotFoundError(f"no run under {directory} logged eval/accuracy")
  os.makedirs(out, exist_ok=True)
  diag = diagnostics(runs, window)
  text = (markdown(arms, baseline) + "\n"
          + paper_diagnostics.markdown(diag, window))
  with open(os.path.join(out, "diagnostics.json"), "w") as f:
    json.dump(paper_diagnostics.to_json(diag, window), f, indent=1)
  with open(os.path.join(out, "comparison.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "curves.json"), "w") as f:
    base = [a for a in arms if a["arm"] == baseline]
    json.dump({a["arm"]: {
        **{k: v for k, v in a.items() if not k.startswith("_")},
        "gaps": gaps(a, base[0]) if base and a is not base[0] else None}
               for a in arms}, f, indent=1)
  plot(arms, os.path.join(out, "accuracy.png"))
  return text


def main(argv: Sequence[str] | None = None) -> None:
  # argparse, not absl flags: tests import this module beside report.py,
  # whose absl flags (--out) would be defined twice.
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("sweep_dir", help="The sweep's directory (runs/...).")
  p.add_argument("--out", required=True, help="Output directory.")
  p.add_argument("--baseline", default="sao", help="The arm gaps are to.")
  p.add_argument("--problems", type=int, default=256,
                 help="Held-out problems per eval where a run does not log "
                 "eval/num_problems.")
  p.add_argument("--window", type=int, default=10,
                 help="Policy steps per row of the diagnostics table.")
  args = p.parse_args(argv)
  print(make(args.sweep_dir, args.out, args.baseline, args.problems,
             args.window))


if __name__ == "__main__":
  main()
