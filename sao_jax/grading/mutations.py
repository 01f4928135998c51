"""Procedural bugs: one AST mutation of a Python module, picked by a seed.

In the manner of SWE-smith's procedural bug generators (operation change,
flipped operator, swapped operands, changed constant, inverted if/else,
removed assignment/conditional/loop): each family finds its sites in the
module's functions; a seed picks a family among those with sites, then a
site. The bug is spliced into the original text (only the mutated span, or
the removed statement's lines, change), so comments and layout stay and the
diff against the reference is one hunk. Whether a bug is kept (it must make
a test fail) is decided by running the tests: `grading/repair.py`.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import random
from typing import Callable, Iterator

# Operator changes: a plausible slip for each operator.
_BINOP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv,
          ast.FloorDiv: ast.Mult, ast.Div: ast.Mult, ast.Mod: ast.FloorDiv,
          ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.LShift:
          ast.RShift, ast.RShift: ast.LShift}
# Flipped comparisons: the negation.
_FLIP = {ast.Lt: ast.GtE, ast.GtE: ast.Lt, ast.Gt: ast.LtE, ast.LtE: ast.Gt,
         ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.In: ast.NotIn,
         ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
# Boundary slips: strict <-> non-strict.
_BOUNDARY = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE,
             ast.GtE: ast.Gt}
_NON_COMMUTATIVE = (ast.Sub, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
                    ast.LShift, ast.RShift)
_REMOVABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.If,
              ast.For, ast.While, ast.Return, ast.Continue, ast.Break)


@dataclasses.dataclass(frozen=True)
class Mutation:
  """What was changed: the family, where (1-based line), before and after."""

  kind: str
  line: int
  before: str
  after: str


def _functions(tree: ast.Module) -> Iterator[ast.AST]:
  """Every node inside a function body (docstrings and f-strings left
  out), in source order."""
  out = []
  for fn in ast.walk(tree):
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    body = fn.body[1:] if _is_docstring(fn.body[0]) else fn.body
    for stmt in body:
      for node in ast.walk(stmt):
        if isinstance(node, ast.JoinedStr):
          continue
        out.append(node)
  seen = set()
  for node in sorted(out, key=lambda n: (getattr(n, "lineno", 0),
                                         getattr(n, "col_offset", 0))):
    if id(node) not in seen:  # Nested functions are walked twice.
      seen.add(id(node))
      yield node


def _is_docstring(stmt: ast.stmt) -> bool:
  return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
          and isinstance(stmt.value.value, str))


def _binop(node):
  if isinstance(node, ast.BinOp) and type(node.op) in _BINOP:
    new = copy.copy(node)
    new.op = _BINOP[type(node.op)]()
    yield new


def _compare_to(node, table):
  """A copy of a one-operator comparison with its operator mapped by
  `table`, or None."""
  if (isinstance(node, ast.Compare) and len(node.ops) == 1
      and type(node.ops[0]) in table):
    new = copy.copy(node)
    new.ops = [table[type(node.ops[0])]()]
    return new
  return None


def _flip(node):
  new = _compare_to(node, _FLIP)
  if new is not None:
    yield new
  elif isinstance(node, ast.BoolOp):
    new = copy.copy(node)
    new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    yield new


def _boundary(node):
  new = _compare_to(node, _BOUNDARY)
  if new is not None:
    yield new


def _swap(node):
  if isinstance(node, ast.BinOp) and isinstance(node.op, _NON_COMMUTATIVE):
    new = copy.copy(node)
    new.left, new.right = node.right, node.left
    yield new
  elif (isinstance(node, ast.Compare) and len(node.ops) == 1 and
        not isinstance(node.ops[0], (ast.Eq, ast.NotEq, ast.Is, ast.IsNot))):
    new = copy.copy(node)
    new.left, new.comparators = node.comparators[0], [node.left]
    yield new


def _constant(node):
  if (isinstance(node, ast.Constant) and type(node.value) is int and
      not isinstance(node.value, bool)):
    for delta in (1, -1):
      new = copy.copy(node)
      new.value = node.value + delta
      yield new


def _invert(node):
  if isinstance(node, (ast.If, ast.While, ast.IfExp)):
    test = node.test
    yield ("test", test.operand if isinstance(test, ast.UnaryOp) and
           isinstance(test.op, ast.Not) else ast.UnaryOp(ast.Not(), test))


def _remove(node):
  for field in ("body", "orelse"):
    stmts = getattr(node, field, None)
    if isinstance(stmts, list) and len(stmts) > 1:
      for i, stmt in enumerate(stmts):
        if isinstance(stmt, _REMOVABLE) and not _is_docstring(stmt):
          yield ("remove", field, i)


# family -> a function of a node giving its mutants: a replacement node, or
# ("test", new test) for the node's condition, or ("remove", field, index).
FAMILIES: dict[str, Callable] = {
    "change_operator": _binop, "flip_operator": _flip,
    "boundary": _boundary, "swap_operands": _swap,
    "off_by_one": _constant, "invert_condition": _invert,
    "remove_statement": _remove,
}


def sites(source: str) -> dict[str, list[tuple[ast.AST, object]]]:
  """family -> [(node, mutant)] of `source`, in source order."""
  tree = ast.parse(source)
  out: dict[str, list] = {k: [] for k in FAMILIES}
  for node in _functions(tree):
    if not hasattr(node, "lineno"):
      continue
    for kind, fn in FAMILIES.items():
      out[kind].extend((node, m) for m in fn(node))
  return out


def _span(lines: list[str], node: ast.AST) -> tuple[int, int]:
  """Offsets of `node`'s text in the joined `lines`."""
  starts = [0]
  for line in lines:
    starts.append(starts[-1] + len(line))

  def offset(lineno: int, col: int) -> int:  # col: UTF-8 bytes.
    return starts[lineno - 1] + len(
        lines[lineno - 1].encode()[:col].decode(errors="replace"))

  return (offset(node.lineno, node.col_offset),
          offset(node.end_lineno, node.end_col_offset))


def _apply(source: str, node: ast.AST, mutant) -> str | None:
  """`source` with one mutation spliced in, or None when the splice does not
  parse to the mutated tree."""
  lines = source.splitlines(keepends=True)
  if isinstance(mutant, tuple) and mutant[0] == "remove":
    stmt = getattr(node, mutant[1])[mutant[2]]
    first, last = lines[stmt.lineno - 1], lines[stmt.end_lineno - 1]
    if (first[:stmt.col_offset].strip() or
        last.encode()[stmt.end_col_offset:].decode().strip()[:1] not in
        ("", "#")):
      return None  # Shares a line with another statement.
    return "".join(lines[:stmt.lineno - 1] + lines[stmt.end_lineno:])
  if isinstance(mutant, tuple):  # A new condition.
    target, text = node.test, ast.unparse(mutant[1])
  else:
    target, text = node, ast.unparse(mutant)
  start, end = _span(lines, target)
  joined = "".join(lines)
  for candidate in (text, "(" + text + ")"):
    out = joined[:start] + candidate + joined[end:]
    try:
      ast.parse(out)
    except SyntaxError:
      continue
    if _parses_as(out, joined, target, mutant):
      return out
  return None


def _parses_as(out: str, joined: str, target: ast.AST, mutant) -> bool:
  """Whether `out` differs from `joined` exactly by the mutation (so that
  precedence did not regroup what surrounds it)."""
  new = mutant[1] if isinstance(mutant, tuple) else mutant
  want = ast.dump(new)
  for node in ast.walk(ast.parse(out)):
    if (getattr(node, "lineno", None) == target.lineno and
        getattr(node, "col_offset", None) in (target.col_offset,
                                              target.col_offset + 1) and
        ast.dump(node) == want):
      return True
  return False


def mutate(source: str, seed: int) -> tuple[str, Mutation] | None:
  """One bug in `source`, picked by `seed` (the same seed, the same bug), or
  None when the module has no site."""
  found = sites(source)
  kinds = [k for k in sorted(found) if found[k]]
  rng = random.Random(seed)
  while kinds:
    kind = rng.choice(kinds)
    options = found[kind]
    for i in rng.sample(range(len(options)), len(options)):
      node, mutant = options[i]
      out = _apply(source, node, mutant)
      if out is not None and ast.dump(ast.parse(out)) != ast.dump(
          ast.parse(source)):
        line = node.lineno
        if isinstance(mutant, tuple) and mutant[0] == "remove":
          stmt = getattr(node, mutant[1])[mutant[2]]
          line, before, after = stmt.lineno, ast.unparse(stmt), ""
        elif isinstance(mutant, tuple):
          before, after = ast.unparse(node.test), ast.unparse(mutant[1])
        else:
          before, after = ast.unparse(node), ast.unparse(mutant)
        return out, Mutation(kind, line, before, after)
    kinds.remove(kind)
  return None
