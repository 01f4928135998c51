r"""The paper's main comparison as a table, curves and a plot (issue 29).

Reads a sweep of `configs/paper_smollm2.py` (every point's TensorBoard events,
through ``report_runs``; it never re-runs anything) and writes to ``--out``:

- ``comparison.md``: per arm, held-out accuracy at every eval (by policy
  step: the policy version it evaluated) with its
  standard error, the mean DIS-masked fraction (1 - ``policy/accept_frac``;
  the PPO clip fraction for an arm without DIS), the mean staleness, rollouts
  and wall time; then each arm's gap to ``--baseline`` at every eval step,
  whether it exceeds twice its standard error, and where the curves cross;
- ``curves.json``: the raw points (step, accuracy, standard error) per arm;
- ``accuracy.png``: the curves with their error bars.

The standard error of an accuracy p over n held-out problems is the binomial
sqrt(p (1 - p) / n); a gap's is sqrt(se_a^2 + se_b^2), which treats the two
arms' evaluations as independent. They are the same n problems, so that is
conservative: a paired error would be smaller. One run per arm measures the
evaluation's noise, not the seed-to-seed spread of training.

  python experiments/paper_comparison.py runs/paper_smollm2 \
      --out=experiments/results/paper_smollm2
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import json
import math
import os
from typing import Any

import numpy as np
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


def arm_summary(run: report_runs.RunData, problems: int) -> dict[str, Any]:
  """One arm's curve and figures (None where the run lacks a tag)."""
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
  }


def gaps(arm: dict[str, Any], base: dict[str, Any]) -> list[dict[str, Any]]:
  """arm - base at the eval steps both have, with the gap's standard error."""
  at = {p["step"]: p for p in base["curve"]}
  out = []
  for p in arm["curve"]:
    if p["step"] in at:
      b = at[p["step"]]
      se = math.hypot(p["se"], b["se"])
      gap = p["accuracy"] - b["accuracy"]
      out.append({"step": p["step"], "gap": gap, "se": se,
                  "beyond_2se": abs(gap) > 2 * se})
  return out


def crossings(gap_points: Sequence[dict[str, Any]]) -> list[int]:
  """Policy steps at which the gap changes sign from the previous eval's."""
  signs = [(g["step"], np.sign(g["gap"])) for g in gap_points]
  return [s for (_, a), (s, b) in zip(signs, signs[1:])
          if a and b and a != b]


def _f(x: float | None, digits: int = 3) -> str:
  return "—" if x is None else f"{x:.{digits}f}"


def markdown(arms: Sequence[dict[str, Any]], baseline: str) -> str:
  """The comparison's tables."""
  steps = sorted({p["step"] for a in arms for p in a["curve"]})
  lines = ["| arm | " + " | ".join(f"v{s}" for s in steps) +
           " | masked / clipped | staleness | rollouts | wall |",
           "|---" * (len(steps) + 5) + "|"]
  for a in arms:
    at = {p["step"]: p for p in a["curve"]}
    cells = [f"{at[s]['accuracy']:.3f} ± {at[s]['se']:.3f}" if s in at
             else "—" for s in steps]
    masked = (f"{a['masked_frac']:.4f} ({a['masked_kind']})"
              if a["masked_frac"] is not None else "—")
    wall = "—" if a["wall_s"] is None else f"{a['wall_s'] / 60:.0f} min"
    lines.append(f"| {a['arm']} | " + " | ".join(cells) + f" | {masked} | "
                 f"{_f(a['staleness'], 2)} | {_f(a['rollouts'], 0)} | "
                 f"{wall} |")
  base = [a for a in arms if a["arm"] == baseline]
  if base:
    lines += ["", f"Gap to {baseline} (accuracy points; * beyond 2 SE):", "",
              "| arm | " + " | ".join(f"v{s}" for s in steps) +
              " | crosses at |", "|---" * (len(steps) + 2) + "|"]
    for a in arms:
      if a is base[0]:
        continue
      g = {p["step"]: p for p in gaps(a, base[0])}
      cells = [f"{100 * g[s]['gap']:+.1f} ± {100 * g[s]['se']:.1f}"
               + ("*" if g[s]["beyond_2se"] else "") if s in g else "—"
               for s in steps]
      cross = crossings(list(g.values()))
      lines.append(f"| {a['arm']} | " + " | ".join(cells) + " | " +
                   (", ".join(f"v{s}" for s in cross) or "no") + " |")
  return "\n".join(lines) + "\n"


def plot(arms: Sequence[dict[str, Any]], path: str) -> None:
  """Accuracy vs policy step per arm, with standard-error bars."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6, 4))
  for a in arms:
    c = a["curve"]
    ax.errorbar([p["step"] for p in c], [p["accuracy"] for p in c],
                yerr=[p["se"] for p in c], capsize=3, marker="o",
                label=a["arm"])
  ax.set_xlabel("policy step")
  ax.set_ylabel("held-out accuracy (± SE)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def make(directory: str, out: str, baseline: str = "sao",
         problems: int = 256) -> str:
  """Writes comparison.md, curves.json and accuracy.png; returns the md."""
  arms = [arm_summary(r, problems) for r in report_runs.load_runs([directory])
          if r.has("eval/accuracy")]
  if not arms:
    raise FileNotFoundError(f"no run under {directory} logged eval/accuracy")
  os.makedirs(out, exist_ok=True)
  text = markdown(arms, baseline)
  with open(os.path.join(out, "comparison.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "curves.json"), "w") as f:
    json.dump({a["arm"]: a for a in arms}, f, indent=1)
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
  args = p.parse_args(argv)
  print(make(args.sweep_dir, args.out, args.baseline, args.problems))


if __name__ == "__main__":
  main()
