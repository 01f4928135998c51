r"""Results report from TensorBoard event files: Markdown tables and PNG plots.

Reads the scalars that `sao_jax.train.metrics.MetricWriter` wrote (it never
re-runs anything) and writes ``OUT_DIR/report.md`` plus one PNG per plot; the
Markdown is also printed to stdout.

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

import collections
from collections.abc import Sequence
import dataclasses
import math
import os
import re
import sys
from typing import Any

from absl import app
from absl import flags
import numpy as np

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
ADAPT_WINDOW = 20  # Policy versions before a switch that set the reference.
EV_LAST_N = 3
Series = tuple[np.ndarray, np.ndarray]  # (steps, values), sorted by step.

_SEED_TOKEN = re.compile(
    r"(^|[/_.,\-])seed[=_\-]?\d+($|[/_.,\-])", re.IGNORECASE)


@dataclasses.dataclass
class RunData:
  """Scalar series of one run: ``{tag: (steps, values)}``."""
  label: str
  path: str
  scalars: dict[str, Series]

  def has(self, tag: str) -> bool:
    return tag in self.scalars and self.scalars[tag][0].size > 0

  def series(self, tag: str) -> Series:
    if tag in self.scalars:
      return self.scalars[tag]
    return np.zeros(0, np.int64), np.zeros(0, np.float64)

  def last(self, tag: str) -> float | None:
    return float(self.scalars[tag][1][-1]) if self.has(tag) else None


# -----------------------------------------------------------------------------
# Reading.


def _event_file_key(name: str) -> tuple[int, int, str]:
  """Orders ``events.out.tfevents.<time>.<host>.<pid>.<uid>`` oldest first."""
  parts = name.split(".")
  wall = int(parts[3]) if len(parts) > 3 and parts[3].isdigit() else 0
  uid = int(parts[-1]) if parts[-1].isdigit() else 0
  return wall, uid, name


def read_event_scalars(tb_dir: str) -> dict[str, Series]:
  """Reads every scalar under ``tb_dir`` (not recursive) as ``{tag: Series}``.

  Reads the raw records (no reservoir sampling, no purging of out-of-order
  steps); when several files hold the same (tag, step), e.g. a resumed run, the
  newest file wins.
  """
  from tensorboard.backend.event_processing import event_file_loader  # pylint: disable=g-import-not-at-top
  from tensorboard.util import tensor_util  # pylint: disable=g-import-not-at-top

  data: dict[str, dict[int, float]] = collections.defaultdict(dict)
  names = [n for n in os.listdir(tb_dir) if n.startswith("events.out.tfevents")]
  for name in sorted(names, key=_event_file_key):
    loader = event_file_loader.LegacyEventFileLoader(os.path.join(tb_dir, name))
    for event in loader.Load():
      if not event.HasField("summary"):
        continue
      for value in event.summary.value:
        kind = value.WhichOneof("value")
        if kind == "simple_value":
          data[value.tag][int(event.step)] = float(value.simple_value)
        elif kind == "tensor":
          array = tensor_util.make_ndarray(value.tensor)
          if array.size == 1 and np.issubdtype(array.dtype, np.number):
            data[value.tag][int(event.step)] = float(array.reshape(()))
  out = {}
  for tag, by_step in data.items():
    steps = np.array(sorted(by_step), dtype=np.int64)
    out[tag] = steps, np.array([by_step[s] for s in steps], dtype=np.float64)
  return out


def _natural_key(name: str) -> list[Any]:
  """Sorts 'eta4' before 'eta16' (digit runs compare as numbers)."""
  return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def find_runs(directory: str) -> list[tuple[str, str]]:
  """Returns ``[(label, run_dir)]`` for a run dir or a sweep dir.

  Raises:
    FileNotFoundError: ``directory`` does not exist or holds no run.
  """
  directory = os.path.normpath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no such directory: {directory}")
  base = os.path.basename(os.path.abspath(directory))
  if os.path.isdir(os.path.join(directory, "tb")):
    return [(base, directory)]
  runs = [(f"{base}/{point}", os.path.join(directory, point))
          for point in sorted(os.listdir(directory), key=_natural_key)
          if os.path.isdir(os.path.join(directory, point, "tb"))]
  if not runs:
    raise FileNotFoundError(
        f"{directory} is neither a run dir (no tb/) nor a sweep dir (no "
        "<point>/tb/ below it)")
  return runs


def load_run(run_dir: str, label: str | None = None) -> RunData:
  """Loads the scalars of ``run_dir/tb``."""
  tb_dir = os.path.join(run_dir, "tb")
  if not os.path.isdir(tb_dir):
    raise FileNotFoundError(f"no tb/ directory in {run_dir}")
  if label is None:
    label = os.path.basename(os.path.abspath(run_dir))
  return RunData(label=label, path=run_dir, scalars=read_event_scalars(tb_dir))


def load_runs(directories: Sequence[str]) -> list[RunData]:
  """Loads every run of ``directories``; repeated labels get a ``#k`` suffix."""
  runs, seen = [], collections.Counter()
  for directory in directories:
    for label, run_dir in find_runs(directory):
      seen[label] += 1
      if seen[label] > 1:
        label = f"{label}#{seen[label]}"
      runs.append(load_run(run_dir, label))
  return runs


# -----------------------------------------------------------------------------
# Numbers.


def tokens_at(run: RunData, steps: np.ndarray) -> np.ndarray | None:
  """``tokens/generated_total`` at ``steps``, interpolated linearly in step.

  Before the first logged value, (step 0, 0 tokens) is the anchor (the counter
  starts at zero with RL); after the last, the last value is held. None if the
  run does not log the tag.
  """
  if not run.has("tokens/generated_total"):
    return None
  s, v = run.series("tokens/generated_total")
  s = s.astype(np.float64)
  if s[0] > 0:
    s, v = np.concatenate([[0.0], s]), np.concatenate([[0.0], v])
  return np.interp(np.asarray(steps, np.float64), s, v)


def clip_or_reject(run: RunData) -> tuple[Series, str] | None:
  """The run's clip fraction or DIS reject fraction series, and its kind."""
  if run.has("policy/accept_frac"):
    s, v = run.series("policy/accept_frac")
    return (s, 1.0 - v), "reject"
  if run.has("policy/clip_frac"):
    return run.series("policy/clip_frac"), "clip"
  return None


def _finite_max(values: np.ndarray) -> float | None:
  values = values[np.isfinite(values)]
  return float(values.max()) if values.size else None


def collapse_reason(final: float | None, best: float | None,
                    initial: float | None, loss: np.ndarray | None, *,
                    collapse_frac: float, collapse_drop: float) -> str | None:
  """Returns why a run collapsed, "" if it did not, None if unknown."""
  reasons = []
  if loss is not None and not np.all(np.isfinite(loss)):
    reasons.append("non-finite loss")
  if final is not None and best is not None and final < collapse_frac * best:
    reasons.append(f"final<{collapse_frac:g}×best")
  if (final is not None and initial is not None
      and final < initial - collapse_drop):
    reasons.append(f"final<initial−{collapse_drop:g}")
  if reasons:
    return ", ".join(reasons)
  if loss is None and final is None:
    return None
  return ""


def summarize(run: RunData, target: float = 0.8, *, collapse_frac: float = 0.5,
              collapse_drop: float = 0.1) -> dict[str, Any]:
  """The per-run table row as numbers (None where the run lacks the tag)."""
  row: dict[str, Any] = {"label": run.label}
  es, ev = run.series("eval/accuracy")
  row["final_acc"] = float(ev[-1]) if ev.size else None
  row["best_acc"] = _finite_max(ev) if ev.size else None
  row["initial_acc"] = float(ev[0]) if ev.size else None

  reached = np.flatnonzero(ev >= target)
  row["reached_target"] = bool(reached.size)
  row["step_to_target"] = int(es[reached[0]]) if reached.size else None
  row["tokens_to_target"] = None
  if reached.size:
    tok = tokens_at(run, es[reached[:1]])
    row["tokens_to_target"] = float(tok[0]) if tok is not None else None
  row["total_tokens"] = run.last("tokens/generated_total")

  loss = run.series("policy/loss")[1] if run.has("policy/loss") else None
  reason = collapse_reason(row["final_acc"], row["best_acc"],
                           row["initial_acc"], loss,
                           collapse_frac=collapse_frac,
                           collapse_drop=collapse_drop)
  row["collapse_reason"] = reason
  row["collapsed"] = None if reason is None else bool(reason)

  cr = clip_or_reject(run)
  row["max_clip_reject"] = _finite_max(cr[0][1]) if cr else None
  row["clip_reject_kind"] = cr[1] if cr else None
  row["final_entropy"] = run.last("policy/entropy")
  if run.has("critic/explained_variance"):
    last = run.series("critic/explained_variance")[1][-EV_LAST_N:]
    last = last[np.isfinite(last)]
    row["final_ev"] = float(np.mean(last)) if last.size else None
  else:
    row["final_ev"] = None
  if run.has("summary/staleness_mean"):
    row["mean_staleness"] = run.last("summary/staleness_mean")
  elif run.has("staleness/mean"):
    row["mean_staleness"] = float(np.mean(run.series("staleness/mean")[1]))
  else:
    row["mean_staleness"] = None
  row["wall_s"] = run.last("summary/wall_s")
  return row


def seed_group(label: str) -> str:
  """``label`` without its seed token: ``sao/seed1`` and ``sao/seed2`` -> ``sao``."""

  def join(match: re.Match[str]) -> str:
    before, after = match.group(1), match.group(2)
    if not before or not after:
      return ""
    return "/" if "/" in (before, after) else before

  return _SEED_TOKEN.sub(join, label) or label


def _mean_std(values: list[float]) -> tuple[float, float | None]:
  """Mean and sample std (ddof=1; None for one value)."""
  array = np.asarray(values, np.float64)
  std = float(np.std(array, ddof=1)) if array.size > 1 else None
  return float(np.mean(array)), std


def group_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Aggregates per-run rows over seeds (labels equal up to a seed token)."""
  groups: dict[str, list[dict[str, Any]]] = collections.OrderedDict()
  for row in rows:
    groups.setdefault(seed_group(row["label"]), []).append(row)
  out = []
  for name, members in groups.items():
    agg: dict[str, Any] = {"group": name, "n": len(members),
                           "labels": [m["label"] for m in members]}
    for key in ("final_acc", "best_acc"):
      values = [m[key] for m in members if m[key] is not None]
      agg[key] = _mean_std(values) if values else None
      agg[key + "_n"] = len(values)
    tokens = [m["tokens_to_target"] for m in members
              if m["reached_target"] and m["tokens_to_target"] is not None]
    agg["tokens_to_target"] = float(np.mean(tokens)) if tokens else None
    agg["reached"] = sum(bool(m["reached_target"]) for m in members)
    known = [m["collapsed"] for m in members if m["collapsed"] is not None]
    agg["any_collapse"] = any(known) if known else None
    agg["collapsed_n"] = sum(bool(c) for c in known)
    out.append(agg)
  return out


# -----------------------------------------------------------------------------
# Markdown.


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
            f"last {EV_LAST_N} logged `critic/explained_variance`. "
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
              f"{ADAPT_WINDOW} policy versions before the switch; *dip*: its "
              f"minimum after the switch until it is back to ≥ "
              f"{recover_frac:g} × before; *versions to recover*: policy "
              f"versions from the switch until then ({DASH}: never).", ""]
  if plots:
    parts += ["## Plots", ""]
    for name, caption in plots.items():
      parts += [f"![{caption}]({name})", ""]
  return "\n".join(parts).rstrip() + "\n"


# -----------------------------------------------------------------------------
# Online simulation: adaptation after each style switch.


def reward_by_version(run: RunData) -> Series | None:
  """(policy version, reward/mean) at the logged steps, or None."""
  if not (run.has("reward/mean") and run.has("policy_version")):
    return None
  steps, reward = run.series("reward/mean")
  vsteps, versions = run.series("policy_version")
  return np.interp(steps, vsteps, versions), reward


def adaptation(run: RunData, switches: Sequence[int], *,
               recover_frac: float = 0.8,
               window: int = ADAPT_WINDOW) -> list[dict[str, Any]]:
  """Per switch: reward before, its dip after, versions until it recovers.

  *Before*: mean training reward over the ``window`` versions before the
  switch. The dip starts at the first logged point at or after the switch
  whose reward is < ``recover_frac`` x before (trajectories of older versions,
  still scored under the old style, may come first); *recovered*: the first
  later point with reward >= ``recover_frac`` x before. Versions to recover
  count from the switch; 0 if the reward never dipped, None if it never
  recovered or if the reward before the switch was 0 (shown as n/a).
  """
  rv = reward_by_version(run)
  rows = []
  for sw in switches:
    row = {"run": run.label, "switch": int(sw), "before": None, "dip": None,
           "versions_to_recover": None}
    rows.append(row)
    if rv is None:
      continue
    versions, reward = rv
    before = reward[(versions >= sw - window) & (versions < sw)]
    after = np.nonzero(versions >= sw)[0]
    if not before.size or not after.size:
      continue
    row["before"] = float(before.mean())
    if row["before"] <= 0.0:  # Nothing was earned before: nothing to regain.
      continue
    level = recover_frac * row["before"]
    low = [i for i in after if reward[i] < level]
    if not low:
      row["dip"] = float(reward[after].min())
      row["versions_to_recover"] = 0.0
      continue
    nxt = [i for i in after if i > low[0] and reward[i] >= level]
    end = nxt[0] if nxt else after[-1] + 1
    row["dip"] = float(reward[low[0]:end].min())
    if nxt:
      row["versions_to_recover"] = float(versions[nxt[0]] - sw)
  return rows


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


# -----------------------------------------------------------------------------
# Plots.

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


def _plot_series(run: RunData, name: str) -> tuple[Series, str] | None:
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
    cr = clip_or_reject(run)
    if cr is None:
      return None
    (s, v), kind = cr
    x = tokens_at(run, s)
    return None if x is None else ((x, v), f" ({kind})")
  if not run.has(tag):
    return None
  s, v = run.series(tag)
  x = tokens_at(run, s)
  return None if x is None else ((x, v), suffix)


def plot(runs: Sequence[RunData], out_dir: str, *,
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
    g = seed_group(run.label)
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
      curves = [(run, reward_by_version(run)) for run in runs]
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


# -----------------------------------------------------------------------------
# Entry points.


def make_report(directories: Sequence[str], out_dir: str, *,
                target: float = 0.8, title: str = "Results report",
                collapse_frac: float = 0.5,
                collapse_drop: float = 0.1, switches: Sequence[int] = (),
                recover_frac: float = 0.8) -> str:
  """Reads the runs, writes ``out_dir/report.md`` and the PNGs; the Markdown."""
  runs = load_runs(directories)
  rows = [summarize(r, target, collapse_frac=collapse_frac,
                    collapse_drop=collapse_drop) for r in runs]
  os.makedirs(out_dir, exist_ok=True)
  plots = plot(runs, out_dir, target=target, switches=switches)
  adapt = [row for r in runs
           for row in adaptation(r, switches, recover_frac=recover_frac)]
  markdown = render_markdown(
      rows, group_rows(rows), plots, title=title, target=target,
      collapse_frac=collapse_frac, collapse_drop=collapse_drop,
      sources=directories, adapt=adapt, recover_frac=recover_frac)
  with open(os.path.join(out_dir, "report.md"), "w") as f:
    f.write(markdown)
  return markdown


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
