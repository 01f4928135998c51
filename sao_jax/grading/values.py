"""Comparing a candidate's JSON return values with the expected ones, on
the host (docs/design/grading.md)."""

from __future__ import annotations

import math
from typing import Any

REL_TOL = 1e-6
ABS_TOL = 1e-9


def same(expected: Any, got: Any) -> bool:
  """Whether `got` equals `expected` as decoded JSON: the same structure,
  strings and booleans exactly, numbers within a relative 1e-6 (NaN equals
  NaN). A bool is not a number here (`True` is not `1`)."""
  if isinstance(expected, bool) or isinstance(got, bool):
    return type(expected) is type(got) and expected == got
  if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
    if isinstance(expected, int) and isinstance(got, int):
      return expected == got
    if math.isnan(expected) or math.isnan(got):
      return math.isnan(expected) and math.isnan(got)
    return math.isclose(expected, got, rel_tol=REL_TOL, abs_tol=ABS_TOL)
  if isinstance(expected, list) and isinstance(got, list):
    return len(expected) == len(got) and all(
        same(e, g) for e, g in zip(expected, got))
  if isinstance(expected, dict) and isinstance(got, dict):
    return expected.keys() == got.keys() and all(
        same(v, got[k]) for k, v in expected.items())
  return type(expected) is type(got) and expected == got
