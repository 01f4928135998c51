r"""Results report from TensorBoard event files: Markdown tables and PNG plots.

Reads the scalars that `sao_jax.train.metrics.MetricWriter` wrote (it never
re-runs anything) and writes ``OUT_DIR/report.md`` plus one PNG per plot and
``OUT_DIR/curves.json`` (the points of the main curves, per run); the
Markdown is also printed to stdout. ``report_runs.py`` reads the runs and
computes the numbers below, ``report_plots.py`` draws the plots.

  python experiments/report.py DIR... --out=OUT_DIR [--target=0.8] \
      [--title=...] [--collapse_frac=0.5] [--collapse_drop=0.1]

Each DIR is a run dir (it holds ``tb/`` with event files; label
``basename(DIR)``) or a sweep dir whose subdirectories are run dirs
(``DIR/<point>/tb/``; label ``basename(DIR)/<point>``; subdirs without ``tb/``,
e.g. ``sft_cache``, are ignored).

Per-run table: final / best / initial held-out accuracy (``eval/accuracy``: last,
max, first by step), generated tokens to reach ``--target`` (the value of
``tokens/generated_total`` at the first eval with accuracy >= target; at an eval
step with no same-step tokens value it is interpolated linearly in step, with
(step 0, 0 tokens) as an anchor before the first logged value and the last value
held after it), total generated tokens (last ``tokens/generated_total``),
collapse, max clip/reject fraction (max over training of ``policy/clip_frac``
and of ``1 - policy/accept_frac``, whichever the run logs), final
``policy/entropy``, final explained variance (mean of the last 3 logged
``critic/explained_variance``), mean staleness (``summary/staleness_mean``, over
every trained trajectory, else the mean of the logged ``staleness/mean``) and
wall time (``summary/wall_s``). A missing tag shows as "—".

Collapse (thresholds are flags): a run collapsed if any logged ``policy/loss`` is
non-finite, or final accuracy < ``collapse_frac`` x best accuracy, or final
accuracy < initial accuracy - ``collapse_drop``. With neither ``policy/loss``
nor ``eval/accuracy`` it is unknown ("—").

Grouped table: runs whose labels differ only by a seed token (``seed0``,
``seed_1``, ``seed=2``, ``seed-3`` as a ``/``, ``_``, ``-``, ``.`` or ``,``
separated part of the label) are aggregated: mean ± sample std (ddof=1; "—" for
a single seed) of final and best accuracy, mean tokens-to-target over the seeds
that reached it plus "k/n reached", and whether any seed collapsed.
"""

from __future__ import annotations

from collections.abc import Sequence
import json
import math
import os
import sys
from typing import Any

from absl import app
from absl import flags
import report_plots
import report_runs

_OUT = flags.DEFINE_string("out", None, "Output directory (report.md, PNGs).")
_TARGET = flags.DEFINE_float("target", 0.8, "Held-out accuracy target.")
_TITLE = flags.DEFINE_string("title", "Results report", "Report title.")
_COLLAPSE_FRAC = flags.DEFINE_float(
    "collapse_frac", 0.5,
    "Collapsed if final accuracy < collapse_frac x best accuracy.")
_COLLAPSE_DROP = flags.DEFINE_float(
    "collapse_drop", 0.1,
    "Collapsed if final accuracy < initial accuracy - collapse_drop.")
_SWITCHES = flags.DEFINE_list(
    "switch_versions", [],
    "Policy versions at which the online simulation's required style switches "
    "(e.g. 100,200); adds an adaptation table and a reward-vs-version plot.")
_RECOVER_FRAC = flags.DEFINE_float(
    "recover_frac", 0.8,
    "Adaptation: recovered when the training reward is back to this share of "
    "its mean over the last versions before the switch.")

DASH = "—"
# The curves written to OUT_DIR/curves.json, per run (those it logged).
CURVE_TAGS = ("eval/accuracy", "reward/mean", "tokens/generated_total",
              "policy/loss", "policy/grad_norm", "policy/entropy",
              "policy/accept_frac", "policy/clip_frac", "staleness/mean")


# --- Markdown ---


def _fmt(x: float | None, digits: int = 3) -> str:
  if x is None or (isinstance(x, float) and math.isnan(x)):
    return DASH
  return f"{x:.{digits}f}"


def _fmt_tokens(x: float | None) -> str:
  return DASH if x is None else f"{int(round(x)):,}"


def _fmt_mean_std(ms: tuple[float, float | None] | None) -> str:
  if ms is None:
    return DASH
  mean, std = ms
  return f"{mean:.3f} ± {DASH if std is None else f'{std:.3f}'}"


def _table(header: list[str], body: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(cells) + " |" for cells in body]
  return "\n".join(lines)


RUN_COLUMNS = ["run", "final acc", "best acc", "initial acc",
               "tokens to target", "total tokens", "collapse",
               "max clip/reject frac", "final entropy", "final EV",
               "mean staleness", "wall s"]
GROUP_COLUMNS = ["group", "n seeds", "final acc (mean ± std)",
                 "best acc (mean ± std)", "tokens to target (mean)",
                 "reached", "any collapse"]


def run_table(rows: Sequence[dict[str, Any]]) -> str:
  """The per-run Markdown table."""
  body = []
  for r in rows:
    if r["collapsed"] is None:
      collapse = DASH
    else:
      collapse = f"yes ({r['collapse_reason']})" if r["collapsed"] else "no"
    clip = _fmt(r["max_clip_reject"])
    if r["max_clip_reject"] is not None:
      clip += f" ({r['clip_reject_kind']})"
    body.append([
        r["label"], _fmt(r["final_acc"]), _fmt(r["best_acc"]),
        _fmt(r["initial_acc"]), _fmt_tokens(r["tokens_to_target"]),
        _fmt_tokens(r["total_tokens"]), collapse, clip,
        _fmt(r["final_entropy"]), _fmt(r["final_ev"]),
        _fmt(r["mean_staleness"], 2), _fmt(r["wall_s"], 0)])
  return _table(RUN_COLUMNS, body)


def group_table(groups: Sequence[dict[str, Any]]) -> str:
  """The seed-aggregated Markdown table."""
  body = []
  for g in groups:
    if g["any_collapse"] is None:
      collapse = DASH
    else:
      collapse = (f"yes ({g['collapsed_n']}/{g['n']})" if g["any_collapse"]
                  else "no")
    body.append([
        g["group"], str(g["n"]), _fmt_mean_std(g["final_acc"]),
        _fmt_mean_std(g["best_acc"]), _fmt_tokens(g["tokens_to_target"]),
        f"{g['reached']}/{g['n']} reached", collapse])
  return _table(GROUP_COLUMNS, body)


def render_markdown(rows: Sequence[dict[str, Any]],
                    groups: Sequence[dict[str, Any]], plots: dict[str, str], *,
                    title: str, target: float, collapse_frac: float,
                    collapse_drop: float, sources: Sequence[str] = (),
                    adapt: Sequence[dict[str, Any]] = (),
                    recover_frac: float = 0.8) -> str:
  """The whole report: tables, their footnotes and the plot links."""
  parts = [f"# {title}", ""]
  if sources:
    parts += ["Event files read from: " +
              ", ".join(f"`{s}`" for s in sources), ""]
  parts += [f"## Runs ({len(rows)})", "", run_table(rows), "",
            f"Accuracy is held-out greedy accuracy (`eval/accuracy`); "
            f"*tokens to target*: generated action tokens "
            f"(`tokens/generated_total`) at the first eval with accuracy ≥ "
            f"{target:g}. *Collapse*: any non-finite `policy/loss`, or final "
            f"accuracy < {collapse_frac:g} × best, or final accuracy < "
            f"initial − {collapse_drop:g}. *Max clip/reject frac*: max over "
            f"training of `policy/clip_frac` (clip) or of "
            f"1 − `policy/accept_frac` (DIS reject). *Final EV*: mean of the "
            f"last {report_runs.EV_LAST_N} logged `critic/explained_variance`. "
            f"{DASH}: not logged by this run.", ""]
  if any(g["n"] > 1 for g in groups):
    parts += ["## Seeds aggregated", "", group_table(groups), "",
              "Mean ± sample standard deviation (ddof=1) over the seeds of a "
              "group; tokens to target: mean over the seeds that reached "
              "it.", ""]
  if adapt:
    parts += ["## Adaptation after each style switch", "",
              adaptation_table(adapt), "",
              f"*Reward before*: mean training `reward/mean` over the "
              f"{report_runs.ADAPT_WINDOW} policy versions before the switch; "
              f"*dip*: its "
              f"minimum after the switch until it is back to ≥ "
              f"{recover_frac:g} × before; *versions to recover*: policy "
              f"versions from the switch until then ({DASH}: never).", ""]
  if plots:
    parts += ["## Plots", ""]
    for name, caption in plots.items():
      parts += [f"![{caption}]({name})", ""]
  return "\n".join(parts).rstrip() + "\n"


def adaptation_table(rows: Sequence[dict[str, Any]]) -> str:
  def recover(r: dict[str, Any]) -> str:
    if r["before"] is not None and r["before"] <= 0.0:
      return "n/a (reward 0 before)"
    if r["versions_to_recover"] is None:
      return DASH
    return f"{r['versions_to_recover']:.0f}"

  body = [[r["run"], str(r["switch"]), _fmt(r["before"]), _fmt(r["dip"]),
           recover(r)] for r in rows]
  return _table(["run", "switch at version", "reward before", "dip",
                 "versions to recover"], body)


# --- Entry points ---


def make_report(directories: Sequence[str], out_dir: str, *,
                target: float = 0.8, title: str = "Results report",
                collapse_frac: float = 0.5,
                collapse_drop: float = 0.1, switches: Sequence[int] = (),
                recover_frac: float = 0.8) -> str:
  """Reads the runs, writes ``out_dir/report.md`` and the PNGs; the Markdown."""
  runs = report_runs.load_runs(directories)
  rows = [report_runs.summarize(r, target, collapse_frac=collapse_frac,
                    collapse_drop=collapse_drop) for r in runs]
  os.makedirs(out_dir, exist_ok=True)
  plots = report_plots.plot(runs, out_dir, target=target, switches=switches)
  adapt = [row for r in runs
           for row in report_runs.adaptation(r, switches,
                                             recover_frac=recover_frac)]
  markdown = render_markdown(
      rows, report_runs.group_rows(rows), plots, title=title, target=target,
      collapse_frac=collapse_frac, collapse_drop=collapse_drop,
      sources=directories, adapt=adapt, recover_frac=recover_frac)
  with open(os.path.join(out_dir, "report.md"), "w") as f:
    f.write(markdown)
  with open(os.path.join(out_dir, "curves.json"), "w") as f:
    json.dump(curves(runs), f, indent=1)
  return markdown


def curves(runs: Sequence[report_runs.RunData]) -> dict[str, Any]:
  """``{label: {tag: [[step, value], ...]}}`` of the ``CURVE_TAGS`` each run
  logged (the points behind the plots); a non-finite value is null."""
  out = {}
  for run in runs:
    out[run.label] = {}
    for tag in CURVE_TAGS:
      if run.has(tag):
        steps, values = run.series(tag)
        out[run.label][tag] = [[int(s), float(v) if math.isfinite(v) else None]
                               for s, v in zip(steps, values)]
  return out


def main(argv: Sequence[str]) -> None:
  directories = argv[1:]
  if not directories:
    raise app.UsageError("Give at least one run or sweep DIR.")
  if not _OUT.value:
    raise app.UsageError("--out=OUT_DIR is required.")
  try:
    markdown = make_report(
        directories, _OUT.value, target=_TARGET.value, title=_TITLE.value,
        collapse_frac=_COLLAPSE_FRAC.value, collapse_drop=_COLLAPSE_DROP.value,
        switches=[int(v) for v in _SWITCHES.value],
        recover_frac=_RECOVER_FRAC.value)
  except FileNotFoundError as e:
    sys.exit(f"report.py: error: {e}")
  print(markdown, end="")


if __name__ == "__main__":
  app.run(main)
