"""The runs a report reads: their scalar series and the numbers of its tables.

Part of ``experiments/report.py`` (which documents every number); the scalars
come from the run's TensorBoard event files through
``sao_jax.train.metrics.read_scalars``.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
import dataclasses
import os
import re
from typing import Any

import numpy as np

from sao_jax.train import metrics

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


# --- Reading ---


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
  scalars = {}
  for tag, points in metrics.read_scalars(tb_dir).items():
    steps, values = zip(*points)
    scalars[tag] = (np.array(steps, np.int64), np.array(values, np.float64))
  return RunData(label=label, path=run_dir, scalars=scalars)


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


# --- Numbers ---


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
  """``label`` minus its seed token: ``sao/seed1``, ``sao/seed2`` -> ``sao``."""

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


# --- Online simulation: adaptation after each style switch ---


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
