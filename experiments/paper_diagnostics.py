r"""Per-step training diagnostics of a paper sweep, by windows of policy steps
(issue 40 items 2-4: why SAO starts slow, what staleness does).

For every arm (its seeds pooled: the mean over seeds of each seed's window
mean) and every window of ``window`` policy steps, the mean of:

- ``critic/explained_variance`` (1 - Var[R - V] / Var[R] of the critic's
  value targets; < 0: worse than a constant baseline) and ``advantage/std``
  (the policy advantages' spread, Eq. 3's A_t);
- the DIS-masked fraction (1 - ``policy/accept_frac``, tokens outside the
  arm's own Eq. 2 band), ``policy/dis_band_out_frac`` (what the paper's
  band would mask, logged by every loss, so also by arms without DIS) and
  ``policy/logp_abs_diff`` (mean |log pi_theta - log mu| over action tokens, the
  trainer-sampler mismatch DIS corrects);
- ``staleness/mean`` (policy versions between acting and learning),
  ``reward/mean`` and ``policy/entropy``.

A window holds the trainer steps whose policy version v satisfies
``w * window < v <= (w + 1) * window``; SAO's critic warm-up steps (v = 0)
are a window of their own (``warm-up``). A tag a run never logged is "—".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import report_runs

# (tag, column, transform of the logged value).
COLUMNS = (
    ("critic/explained_variance", "expl. var.", None),
    ("advantage/std", "adv. std", None),
    ("policy/accept_frac", "DIS-masked", lambda x: 1.0 - x),
    ("policy/dis_band_out_frac", "out of DIS band", None),
    ("policy/logp_abs_diff", "|Δlogp|", None),
    ("staleness/mean", "staleness", None),
    ("reward/mean", "reward", None),
    ("policy/entropy", "entropy", None),
)


def _versions(run: report_runs.RunData, steps: np.ndarray) -> np.ndarray:
  """Policy version at trainer ``steps`` (the step itself without one)."""
  if not run.has("policy_version"):
    return steps
  s, v = run.series("policy_version")
  return np.rint(np.interp(steps, s, v)).astype(np.int64)


def _window(version: int, window: int) -> int:
  """-1 for the warm-up (version 0), else the window's index."""
  return -1 if version <= 0 else (version - 1) // window


def run_windows(run: report_runs.RunData, window: int
                ) -> dict[str, dict[int, float]]:
  """{column: {window index: mean}} of one run."""
  out = {}
  for tag, column, transform in COLUMNS:
    if not run.has(tag):
      continue
    steps, values = run.series(tag)
    values = np.asarray(values, np.float64)
    if transform is not None:
      values = transform(values)
    windows = np.array([_window(int(v), window)
                        for v in _versions(run, np.asarray(steps))])
    out[column] = {int(w): float(np.nanmean(values[windows == w]))
                   for w in np.unique(windows)}
  return out


def arm_windows(runs: Sequence[report_runs.RunData], window: int
                ) -> dict[str, dict[int, float]]:
  """An arm's windows: per column and window, the mean over its runs."""
  per_run = [run_windows(r, window) for r in runs]
  out: dict[str, dict[int, float]] = {}
  for _, column, _ in COLUMNS:
    have = [p[column] for p in per_run if column in p]
    for w in sorted({w for h in have for w in h}):
      vals = [h[w] for h in have if w in h]
      out.setdefault(column, {})[w] = float(np.mean(vals))
  return out


def _label(w: int, window: int) -> str:
  return "warm-up" if w < 0 else f"v{w * window + 1}-{(w + 1) * window}"


def markdown(arms: dict[str, dict[str, dict[int, float]]], window: int
             ) -> str:
  """One table: a row per (arm, window), a column per diagnostic."""
  lines = [f"Diagnostics by window of {window} policy steps (means of the "
           "logged per-step values; several seeds: the mean of their means):",
           "", "| arm | steps | " + " | ".join(c for _, c, _ in COLUMNS) + " |",
           "|---" * (len(COLUMNS) + 2) + "|"]
  for arm, cols in arms.items():
    for w in sorted({w for c in cols.values() for w in c}):
      cells = [cols.get(c, {}).get(w) for _, c, _ in COLUMNS]
      lines.append(f"| {arm} | {_label(w, window)} | " + " | ".join(
          "—" if v is None or np.isnan(v) else f"{v:.4g}" for v in cells)
                   + " |")
  return "\n".join(lines) + "\n"


def to_json(arms: dict[str, dict[str, dict[int, float]]], window: int
            ) -> dict[str, Any]:
  """The same figures keyed by window label (for curves.json)."""
  return {arm: {c: {_label(w, window): v for w, v in ws.items()}
                for c, ws in cols.items()} for arm, cols in arms.items()}
