"""Which edits of a repair candidate may run beside the tests (docs/design/
grading.md "Repository repair").

The tests import the module the policy edited, so its code runs in the
tests' process and could patch the test runner, forge results or read the
reference. A unit of code (a simple statement, or the header of a compound
one: a condition, a loop's target and iterable, a def's name, arguments and
decorators, ...) that names a capability may only be one the buggy tree or
the reference already holds, character for character as an AST. A
capability is an import; a module name bound by an import; a name such as
`sys`, `unittest`, `getattr`, `open`, `exec`; any dunder name, attribute or
keyword; a frame, code, generator or traceback attribute; a string holding
a dunder or a frame attribute (format strings reach attributes). A fix
that changes such a unit must restore the reference's.
"""

from __future__ import annotations

import ast
import re

_NAMES = frozenset((
    "sys os gc ctypes builtins unittest pytest inspect importlib subprocess "
    "signal threading _thread multiprocessing io pathlib shutil socket posix "
    "traceback types marshal pickle code codeop runpy site atexit "
    "faulthandler warnings resource fcntl mmap select tempfile test "
    "exec eval compile getattr setattr delattr globals locals vars dir "
    "open breakpoint exit quit input help memoryview SystemExit "
    "KeyboardInterrupt "
    "BaseException GeneratorExit modules path_hooks meta_path "
    "_getframe settrace setprofile addaudithook stdout stderr").split())
_FRAME_PREFIXES = ("f_", "gi_", "cr_", "ag_", "tb_", "co_")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


def _sensitive_word(word: str, bound: frozenset[str]) -> bool:
  return (word in _NAMES or word in bound or word.startswith(_FRAME_PREFIXES)
          or (word.startswith("__") and word.endswith("__")))


def _import_names(tree: ast.AST) -> frozenset[str]:
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      for alias in node.names:
        out.add((alias.asname or alias.name).split(".")[0])
  return frozenset(out)


def _units(tree: ast.AST):
  """(unit, dump) of every simple statement and compound header, in order."""
  for node in ast.walk(tree):
    if not isinstance(node, (ast.stmt, ast.excepthandler, ast.match_case)):
      continue
    if any(isinstance(getattr(node, f, None), list) and f in _BODIES
           for f in node._fields):
      header = [(f, getattr(node, f)) for f in node._fields
                if f not in _BODIES]
      if isinstance(node, ast.Try) or isinstance(node, ast.TryStar):
        continue  # Its handlers are units of their own.
      dump = type(node).__name__ + repr([
          (f, ast.dump(v) if isinstance(v, ast.AST) else
           [ast.dump(x) if isinstance(x, ast.AST) else x for x in v]
           if isinstance(v, list) else v) for f, v in header])
      yield node, header, dump
    else:
      yield node, [("", node)], ast.dump(node)


def _names_in(header, bound: frozenset[str]) -> list[str]:
  """The capabilities a unit names."""
  found = []
  for _, value in header:
    values = value if isinstance(value, list) else [value]
    for v in values:
      if isinstance(v, str):
        found += [v] if _sensitive_word(v, bound) else []
        continue
      if not isinstance(v, ast.AST):
        continue
      for node in ast.walk(v):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
          found.append("import")
        for word in _words(node):
          if _sensitive_word(word, bound):
            found.append(word)
  return found


def _words(node: ast.AST) -> list[str]:
  """The identifiers a node holds: every text field (a name, an attribute,
  a keyword, a match pattern's attribute or capture, ...), and of a string
  constant the dunders and frame attributes it holds."""
  if isinstance(node, ast.Constant):
    if not isinstance(node.value, (str, bytes)):
      return []
    text = node.value if isinstance(node.value, str) else node.value.decode(
        "latin-1")  # Dunders and frames only: format strings reach them.
    return [w for w in _WORD.findall(text) if w.startswith("__") or
            w.startswith(_FRAME_PREFIXES)]
  out = []
  for _, value in ast.iter_fields(node):
    if isinstance(value, str):
      out.append(value)
    elif isinstance(value, list):
      out += [v for v in value if isinstance(v, str)]
  return out


def refusal(candidate: str, allowed: list[str], path: str = "") -> str:
  """Why `candidate` (a module's new text) may not run beside the tests, or
  '' when it may; `allowed`: the texts whose capability units it may hold
  (the buggy module and the reference)."""
  if not isinstance(candidate, str):
    return f"{path}: not text"
  try:
    # As the importer reads the file (UTF-8 bytes, honouring a coding
    # declaration), and as text: a declared codec (utf-7, say) that makes
    # the two differ would hide code from a vetting of the text alone.
    tree = ast.parse(candidate.encode("utf-8"))
    if ast.dump(tree) != ast.dump(ast.parse(candidate)):
      return (f"{path}: its coding declaration changes what Python reads; "
              "write UTF-8 without one")
    trees = [ast.parse(text) for text in allowed]
    bound = frozenset().union(*(_import_names(t) for t in trees + [tree]))
    ok = {dump for t in trees for _, _, dump in _units(t)}
    for node, header, dump in _units(tree):
      names = _names_in(header, bound)
      if names and dump not in ok:
        line = getattr(node, "lineno", "?")
        return (f"{path}:{line}: a new or changed statement names "
                f"{sorted(set(names))[:4]}; statements that name imports, "
                "dunders, sys/os/unittest or introspection must stay as "
                "they were")
  except SyntaxError as e:
    return f"{path}: does not parse ({e.msg}, line {e.lineno})"
  except (ValueError, RecursionError, MemoryError) as e:  # Null bytes, depth,
    return f"{path}: does not parse ({type(e).__name__})"  # unencodable.
  return ""
