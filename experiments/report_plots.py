"""The plots of ``experiments/report.py``: one PNG per figure some run has."""

from __future__ import annotations

import collections
from collections.abc import Sequence
import os

import numpy as np
import report_runs

PLOT_SPECS = (
    # (file, title, y label, x axis)
    ("accuracy_vs_tokens.png", "Held-out accuracy vs generated tokens",
     "held-out accuracy", "tokens"),
    ("reward_vs_tokens.png", "Mean reward vs generated tokens",
     "reward/mean", "tokens"),
    ("clip_reject_vs_tokens.png",
     "DIS reject / clip fraction vs generated tokens",
     "reject (DIS) or clip fraction", "tokens"),
    ("entropy_vs_tokens.png", "Policy entropy vs generated tokens",
     "policy/entropy", "tokens"),
    ("staleness_vs_step.png", "Mean staleness vs trainer step",
     "staleness/mean (policy versions)", "step"),
)


def _plot_series(run: report_runs.RunData,
                 name: str) -> tuple[report_runs.Series, str] | None:
  """(x, y) of ``run`` for plot ``name`` and a legend suffix, or None."""
  if name == "accuracy_vs_tokens.png":
    tag, suffix = "eval/accuracy", ""
  elif name == "reward_vs_tokens.png":
    tag, suffix = "reward/mean", ""
  elif name == "entropy_vs_tokens.png":
    tag, suffix = "policy/entropy", ""
  elif name == "staleness_vs_step.png":
    if not run.has("staleness/mean"):
      return None
    s, v = run.series("staleness/mean")
    return (s.astype(np.float64), v), ""
  else:
    cr = report_runs.clip_or_reject(run)
    if cr is None:
      return None
    (s, v), kind = cr
    x = report_runs.tokens_at(run, s)
    return None if x is None else ((x, v), f" ({kind})")
  if not run.has(tag):
    return None
  s, v = run.series(tag)
  x = report_runs.tokens_at(run, s)
  return None if x is None else ((x, v), suffix)


def plot(runs: Sequence[report_runs.RunData], out_dir: str, *,
         target: float | None = None,
         switches: Sequence[int] = ()) -> dict[str, str]:
  """Writes one PNG per plot that some run has data for; ``{file: title}``."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  colours = plt.get_cmap("tab10").colors
  group_index: dict[str, int] = {}
  seen_in_group: collections.Counter[str] = collections.Counter()
  styles = {}
  for run in runs:
    g = report_runs.seed_group(run.label)
    group_index.setdefault(g, len(group_index))
    styles[run.label] = (colours[group_index[g] % len(colours)],
                         ("-", "--", ":", "-.")[seen_in_group[g] % 4])
    seen_in_group[g] += 1

  written = {}
  specs = PLOT_SPECS + ((("reward_vs_version.png",
                          "Training reward vs policy version",
                          "reward/mean", "version"),) if switches else ())
  for name, title, ylabel, xaxis in specs:
    if name == "reward_vs_version.png":
      curves = [(run, report_runs.reward_by_version(run)) for run in runs]
      curves = [(run, (c, "")) for run, c in curves if c is not None]
    else:
      curves = [(run, _plot_series(run, name)) for run in runs]
    curves = [(run, c) for run, c in curves if c is not None]
    if not curves:
      continue
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for run, ((x, y), suffix) in curves:
      colour, style = styles[run.label]
      ax.plot(x, y, linestyle=style, color=colour, label=run.label + suffix,
              marker="o" if name == "accuracy_vs_tokens.png" else None,
              markersize=4)
    if name == "accuracy_vs_tokens.png" and target is not None:
      ax.axhline(target, color="grey", linestyle=":", linewidth=1,
                 label=f"target {target:g}")
    if name == "reward_vs_version.png":
      for sw in switches:
        ax.axvline(sw, color="grey", linestyle=":", linewidth=1)
    ax.set_title(title)
    ax.set_xlabel({"tokens": "generated action tokens", "step": "trainer step",
                   "version": "policy version"}[xaxis])
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, name))
    plt.close(fig)
    written[name] = title
  return written
