"""A setting's allowed values, defined once next to the code that uses it.

A `Rule` is a predicate and the words for what it accepts. A typed dataclass
built from a config section at start-up (``ModelConfig``, ``EngineOptions``,
``SamplingParams``, the sandbox's ``Limits``) keeps a table of them, field name
-> rule, and checks its fields with it (`check_fields`); config_validation
checks the same keys with the same tables before any compute starts, in its
own words (``config.model.hidden_size: expected a positive int, got 0``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping


class RangeError(ValueError):
  """A field's value is not what its rule accepts."""

  def __init__(self, field: str, expected: str, value: Any):
    super().__init__(f"{field}={value!r}: expected {expected}.")
    self.field, self.expected, self.value = field, expected, value


@dataclasses.dataclass(frozen=True)
class Rule:
  """`ok(value)` for an allowed value; `expected` says which those are."""

  ok: Callable[[Any], bool]
  expected: str

  def check(self, field: str, value: Any) -> None:
    """Raises `RangeError` when `value` of `field` is not allowed."""
    if not self.ok(value):
      raise RangeError(field, self.expected, value)


def is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def one_of(names: tuple[str, ...], what: str = "one of") -> Rule:
  return Rule(lambda v: v in names, f"{what} {names}")


POSITIVE = Rule(lambda v: is_int(v) and v > 0, "a positive int")
NONNEG = Rule(lambda v: v >= 0, "int >= 0")
GT0 = Rule(lambda v: v > 0, "float > 0")
FINITE_GT0 = Rule(lambda v: 0 < v < math.inf, "a finite float > 0")
UNIT = Rule(lambda v: 0 <= v <= 1, "float in [0, 1]")


def check_fields(obj: Any, rules: Mapping[str, Rule]) -> None:
  """Checks each field of `obj` that `rules` names (`RangeError`)."""
  for name, rule in rules.items():
    rule.check(name, getattr(obj, name))
