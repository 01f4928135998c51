"""Procedural bugs (issue 39 item 2): every family, a seed picks one bug and
always the same, the bug is one small hunk of the original text, and the
capability vetting of repair candidates."""

import ast
import collections
import difflib
import textwrap

import pytest

from sao_jax.grading import mutations
from sao_jax.grading import vetting

_SOURCE = textwrap.dedent('''\
    import sys


    def clip(values, lo, hi):
      """Docstring with 1 < 2 inside: never mutated."""
      out = []
      for v in values:  # A comment that stays.
        if v < lo and lo != hi:
          v = lo
        elif v >= hi or v is None:
          v = hi - 1
        out.append(v * 2 // 2)
      total = len(out) % 7 + (lo | hi & 3)
      return out if total in (0, 1) else out[1:]
    ''')


def _hunks(a, b):
  return [l for l in difflib.unified_diff(a.splitlines(), b.splitlines(),
                                          lineterm="", n=0)
          if l.startswith("@@")]


def test_every_family_has_sites_and_changes_one_hunk():
  found = mutations.sites(_SOURCE)
  assert set(found) == set(mutations.FAMILIES)
  assert all(found[k] for k in found), {k: len(v) for k, v in found.items()}
  kinds = collections.Counter()
  for seed in range(120):
    out, m = mutations.mutate(_SOURCE, seed)
    kinds[m.kind] += 1
    assert ast.dump(ast.parse(out)) != ast.dump(ast.parse(_SOURCE)), m
    assert len(_hunks(_SOURCE, out)) == 1, (m, out)
    assert "A comment that stays." in out and "1 < 2 inside" in out
    assert mutations.mutate(_SOURCE, seed) == (out, m)  # Deterministic.
  assert set(kinds) == set(mutations.FAMILIES), kinds


def test_known_mutants_are_the_intended_ones():
  seen = {}
  for seed in range(200):
    out, m = mutations.mutate(_SOURCE, seed)
    seen[(m.kind, m.before, m.after)] = out
  assert ("flip_operator", "v < lo", "v >= lo") in seen
  assert ("boundary", "v >= hi", "v > hi") in seen
  assert ("swap_operands", "hi - 1", "1 - hi") in seen
  assert ("change_operator", "hi - 1", "hi + 1") in seen
  assert ("off_by_one", "7", "8") in seen or ("off_by_one", "7", "6") in seen
  assert ("flip_operator", "v < lo and lo != hi",
          "v < lo or lo != hi") in seen
  assert ("invert_condition", "v < lo and lo != hi",
          "not (v < lo and lo != hi)") in seen
  removed = seen[("remove_statement", "out.append(v * 2 // 2)", "")]
  assert "out.append" not in removed
  # Precedence: `hi & 3` made `hi | 3` inside `lo | ...` keeps its group.
  grouped = [o for (k, b, _), o in seen.items()
             if k == "change_operator" and b == "hi & 3"]
  assert grouped and all("(lo | (hi | 3))" in o for o in grouped), grouped


def test_a_module_without_functions_has_no_bug():
  assert mutations.mutate("X = 1 + 2\n", 0) is None


_BUGGY = "import sys\n\ndef f(a, b):\n  return a - b\n"
_REFERENCE = "import sys\n\ndef f(a, b):\n  return a + b\n"


@pytest.mark.parametrize("fix", [
    "import sys\n\ndef f(a, b):\n  return a + b\n",
    "import sys\n\ndef f(a, b):\n  # fixed\n  return b + a\n",
    "import sys\n\ndef f(a, b):\n  c = a\n  return c + b\n",
])
def test_plain_fixes_are_not_refused(fix):
  assert vetting.refusal(fix, [_BUGGY, _REFERENCE]) == ""


@pytest.mark.parametrize("attack", [
    "import unittest\nunittest.TestCase.assertEqual = lambda *a: None\n",
    "sys.exit(0)\n",
    "import os\n",
    "from os import _exit\n",
    "x = getattr(f, 'x')\n",
    "def g():\n  return sys.modules\n",
    "class E:\n  def __eq__(self, o):\n    return True\n",
    "def g():\n  return f.__globals__\n",
    "s = '{0.__class__}'.format(1)\n",
    "def g(t):\n  return t.tb_frame\n",
    "exec(open('/usr/lib/python3.11/textwrap.py').read())\n",
    "def g():\n  raise SystemExit\n",
    "def f(a, b):\n  return a + b\n",  # Fine: no capability named.
    "#+AAo-import os+AAo-os._exit(0)\n",  # Hidden by a utf-7 declaration.
    ("def g():\n  match (i for i in [1]):\n"  # No Attribute node.
     "    case object(gi_frame=fr):\n      return fr\n"),
    "def g(x):\n  match x:\n    case {'a': 1, **__dict__}:\n      pass\n",
    "x = 1\0\n",
    "x = " + "(" * 400 + "1" + ")" * 400 + "\n",
])
def test_capabilities_named_anew_are_refused(attack):
  if attack.startswith("#+AAo"):  # Python reads `import os` here.
    attack = "# -*- coding: utf-7 -*-\n" + _BUGGY + attack
  else:
    attack = _BUGGY + attack
  why = vetting.refusal(attack, [_BUGGY, _REFERENCE], "m.py")
  if attack.endswith("def f(a, b):\n  return a + b\n"):
    assert why == ""
  else:
    assert why.startswith("m.py:"), attack


def test_a_changed_statement_naming_sys_must_be_the_references():
  buggy = "import sys\n\ndef f():\n  return sys.maxsize - 1\n"
  ref = "import sys\n\ndef f():\n  return sys.maxsize + 1\n"
  assert vetting.refusal(ref, [buggy, ref]) == ""
  assert vetting.refusal(
      "import sys\n\ndef f():\n  return 1 + sys.maxsize\n", [buggy, ref])
  assert vetting.refusal("def f(:\n", [buggy, ref]).endswith("line 1)")


def test_spans_count_utf8_bytes():
  """Column offsets are UTF-8 bytes: text before the site that is not
  ASCII must not shift the splice."""
  source = 'def f(n):\n  return "héllo→" * (n - 1)\n'
  outs = {mutations.mutate(source, seed)[0] for seed in range(40)}
  assert 'def f(n):\n  return "héllo→" * (n + 1)\n' in outs, outs
  assert 'def f(n):\n  return "héllo→" * (1 - n)\n' in outs, outs
  assert all("héllo→" in o and ast.parse(o) for o in outs), outs
