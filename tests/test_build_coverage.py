"""Checks that the top-level BUILD file matches the Python files of the repo.

Every `.py` file under sao_jax/, configs/, experiments/ and tests/ must be in
a target's srcs, BUILD's globs evaluated here over the tree (so Bazel builds
and tests it; each sao_jax/ module in one py_library, each test file in a
py_test), the files BUILD names literally must exist, each target's `deps`
must provide every `sao_jax` module its sources import, and each test file's
Bazel tags must equal the pytest markers it uses (so
`bazel test //:fast_tests` skips exactly the slow/multiprocess files).

Runs both under plain pytest (against the checkout) and under Bazel (against the
files the `:build_tree` target declares, i.e. the glob of the same folders).
"""

import ast
import collections
from collections.abc import Iterator
import dataclasses
import io
import os
import pathlib
import re
import subprocess
import sys
import tokenize

import pytest

import pytest_main

_COVERED_DIRS = ("configs", "experiments", "sao_jax", "tests")
_MARKERS = ("multiprocess", "ref", "slow")
# A quoted string in BUILD that names a file of the repo (not a label, glob or tag).
_FILE_PATH = re.compile(r"^[\w.\-]+(/[\w.\-]+)*\.(py|ini|txt|json|model|bzl)$")


def _under_bazel() -> bool:
  return "TEST_SRCDIR" in os.environ and "TEST_WORKSPACE" in os.environ


def _repo_root() -> pathlib.Path:
  """The checkout, or under Bazel the runfiles tree of this test."""
  if _under_bazel():
    return pathlib.Path(os.environ["TEST_SRCDIR"]) / os.environ["TEST_WORKSPACE"]
  return pathlib.Path(__file__).absolute().parents[1]


def _build_text() -> str:
  return (_repo_root() / "BUILD").read_text()


def _quoted_paths(build_text: str) -> set[str]:
  """Returns the string literals of BUILD (comments excluded) naming files."""
  paths = set()
  for tok in tokenize.generate_tokens(io.StringIO(build_text).readline):
    if tok.type == tokenize.STRING:
      value = ast.literal_eval(tok.string)
      if _FILE_PATH.match(value):
        paths.add(value)
  return paths


def _python_files(root: pathlib.Path) -> set[str]:
  files = set()
  for top in _COVERED_DIRS:
    for path in (root / top).rglob("*.py"):
      files.add(path.relative_to(root).as_posix())
  return files


def _assigned_literal(build_text: str, name: str) -> object:
  """Returns the literal value assigned to the top-level variable `name`."""
  for node in ast.parse(build_text).body:
    if (isinstance(node, ast.Assign) and len(node.targets) == 1 and
        isinstance(node.targets[0], ast.Name) and node.targets[0].id == name):
      return ast.literal_eval(node.value)
  raise AssertionError(f"BUILD defines no top-level {name} = [...]")


def _markers_used(test_file: pathlib.Path) -> set[str]:
  text = test_file.read_text()
  return {m for m in _MARKERS if re.search(rf"\bpytest\.mark\.{m}\b", text)}


@dataclasses.dataclass
class _Target:
  name: str
  kind: str
  srcs: list[str]
  deps: list[str]
  tags: list[str]
  args: list[str]


def _glob(root: pathlib.Path):
  """Bazel's `glob` over the files under `root` (`**`: any folders)."""

  def files(patterns) -> set[str]:
    out = set()
    for pattern in patterns:
      if pattern.endswith("/**"):
        pattern += "/*"
      out.update(p.relative_to(root).as_posix() for p in root.glob(pattern)
                 if p.is_file())
    return out

  def glob(include, exclude=(), **_):
    return sorted(files(include) - files(exclude))

  return glob


def _targets(build_text: str, root: pathlib.Path | None = None
             ) -> dict[str, _Target]:
  """Evaluates BUILD (Starlark is Python here) with recording rule stand-ins
  and its globs over `root` (default: the tree under test)."""
  targets = {}

  def rule(kind):
    def record(name: str, srcs: list[str] = (), deps: list[str] = (),
               tags: list[str] = (), args: list[str] = (), **_):
      targets[":" + name] = _Target(":" + name, kind, list(srcs), list(deps),
                                    list(tags), list(args))
    return record

  def ignore(*_, **__):
    return []

  scope = {kind: rule(kind) for kind in (
      "py_library", "py_binary", "py_test", "filegroup")}
  scope.update(test_suite=ignore, package=ignore, exports_files=ignore,
               glob=_glob(_repo_root() if root is None else root))
  exec(compile(build_text, "BUILD", "exec"), scope)  # pylint: disable=exec-used
  return targets


def _srcs(targets: dict[str, _Target], kind: str | None = None) -> set[str]:
  return {s for t in targets.values() if kind in (None, t.kind)
          for s in t.srcs}


def _module_files(root: pathlib.Path, dotted: str) -> Iterator[str]:
  """Files importing `dotted` loads: each package's __init__.py and the module."""
  parts = dotted.split(".")
  for i in range(1, len(parts) + 1):
    base = "/".join(parts[:i])
    for candidate in (f"{base}/__init__.py", f"{base}.py"):
      if (root / candidate).is_file():
        yield candidate


def _imported_files(root: pathlib.Path, src: str) -> set[str]:
  """The sao_jax files `src` imports (statements, import_module, `-m` args)."""
  package = src.split("/")[:-1]
  names = set()
  for node in ast.walk(ast.parse((root / src).read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package[:len(package) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
      names.add(base)
      names.update(f"{base}.{alias.name}" for alias in node.names)
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and
          re.fullmatch(r"sao_jax(\.\w+)+", node.value)):
      names.add(node.value)
  files = set()
  for name in names:
    if name == "sao_jax" or name.startswith("sao_jax."):
      files.update(_module_files(root, name))
  return files


def _transitive_srcs(targets: dict[str, _Target], label: str) -> set[str]:
  seen, todo, srcs = set(), [label], set()
  while todo:
    current = todo.pop()
    if current in seen or current not in targets:
      continue
    seen.add(current)
    srcs.update(targets[current].srcs)
    todo.extend(targets[current].deps)
  return srcs


def test_every_dep_label_is_a_target():
  targets = _targets(_build_text())
  unknown = sorted(f"{t.name} -> {d}" for t in targets.values()
                   for d in t.deps if d not in targets)
  assert not unknown, "deps naming no target of BUILD: " + ", ".join(unknown)


def test_deps_provide_every_imported_module():
  root = _repo_root()
  targets = _targets(_build_text())
  owners = collections.defaultdict(set)
  for target in targets.values():
    for src in target.srcs:
      owners[src].add(target.name)
  problems = []
  for target in targets.values():
    available = _transitive_srcs(targets, target.name)
    for src in target.srcs:
      if not src.endswith(".py") or not (root / src).is_file():
        continue
      for needed in sorted(_imported_files(root, src) - available):
        where = " or ".join(sorted(owners[needed])) or "no target"
        problems.append(f"{src} (in {target.name}) imports {needed}, which is "
                        f"in {where}: add it to the deps of {target.name}")
  assert not problems, "Missing BUILD deps:\n" + "\n".join(problems)


def test_quoted_paths_finds_file_strings_only():
  text = ('x = ["sao_jax/a.py", ":lib", "cpu:2", "sao_jax/**/*.py", "BUILD"]\n'
          '# "tests/commented_out.py"\n'
          'y = "pytest.ini" + "tests/"\n')
  assert _quoted_paths(text) == {"sao_jax/a.py", "pytest.ini"}


def test_every_python_file_is_in_build():
  root = _repo_root()
  found = _python_files(root)
  assert "tests/test_build_coverage.py" in found, f"scanned the wrong tree: {root}"
  missing = sorted(found - _srcs(_targets(_build_text())))
  assert not missing, (
      "Python files in no BUILD target's srcs: " + ", ".join(missing) +
      ". A new folder of sao_jax/ needs its own py_library (a glob of it).")


def test_coverage_check_sees_a_file_no_glob_covers(tmp_path: pathlib.Path):
  for path in ("sao_jax/a.py", "sao_jax/sub/b.py", "sao_jax/sub/c.txt"):
    (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / path).write_text("")
  narrow = 'py_library(name = "x", srcs = glob(["sao_jax/*.py"]))'
  assert _srcs(_targets(narrow, tmp_path)) == {"sao_jax/a.py"}
  deep = ('py_library(name = "x", srcs = glob(["sao_jax/**/*.py"], '
          'exclude = ["sao_jax/a.py"]), data = glob(["sao_jax/**"]))')
  assert _srcs(_targets(deep, tmp_path)) == {"sao_jax/sub/b.py"}


def test_each_module_is_in_one_library():
  owners = collections.defaultdict(list)
  for target in _targets(_build_text()).values():
    if target.kind == "py_library":
      for src in target.srcs:
        owners[src].append(target.name)
  twice = sorted(f"{src}: {', '.join(names)}" for src, names in owners.items()
                 if len(names) > 1)
  assert not twice, "Files in the srcs of several py_library: " + "; ".join(
      twice)


def test_build_names_only_existing_files():
  root = _repo_root()
  absent = sorted(p for p in _quoted_paths(_build_text())
                  if not (root / p).is_file())
  assert not absent, (
      "BUILD names files that do not exist: " + ", ".join(absent) +
      ". Remove or rename them in BUILD.")


def _test_files() -> set[str]:
  return {p for p in _python_files(_repo_root())
          if re.fullmatch(r"tests/(.*/)?test_[^/]*\.py", p)}


def test_every_test_file_has_a_test_target():
  run = {a for t in _targets(_build_text()).values() if t.kind == "py_test"
         for a in t.args}
  unlisted = sorted(_test_files() - run)
  assert not unlisted, "Test files no py_test runs: " + ", ".join(unlisted)


def test_test_tags_equal_pytest_markers():
  root = _repo_root()
  wrong = []
  for target in _targets(_build_text()).values():
    if target.kind != "py_test":
      continue
    (test_file,) = target.args
    markers = set(target.tags) - {"cpu:2"}
    used = _markers_used(root / test_file)
    if used != markers:
      wrong.append(f"{test_file}: BUILD says {sorted(markers)}, "
                   f"the file uses {sorted(used)}")
  stale = sorted(set(_assigned_literal(_build_text(), "TEST_MARKERS")) -
                 _test_files())
  assert not wrong, ("Fix the file's line in TEST_MARKERS of BUILD: " +
                     "; ".join(wrong))
  assert not stale, "TEST_MARKERS names no test file: " + ", ".join(stale)


def test_pytest_args_follow_bazel_test_env():
  args = pytest_main.pytest_args(
      ["tests/test_x.py"],
      {"XML_OUTPUT_FILE": "/tmp/out/test.xml", "TESTBRIDGE_TEST_ONLY": "gae"})
  assert args[-1] == "tests/test_x.py"
  assert args[args.index("--junitxml") + 1] == "/tmp/out/test.xml"
  assert args[args.index("-k") + 1] == "gae"
  assert "--junitxml" not in pytest_main.pytest_args(["tests/test_x.py"], {})


def test_runner_fails_when_no_test_is_collected(tmp_path: pathlib.Path):
  empty = tmp_path / "test_empty.py"
  empty.write_text('"""No tests here."""\n')
  proc = subprocess.run(
      [sys.executable, "tests/pytest_main.py", str(empty)],
      cwd=_repo_root(), capture_output=True, text=True, timeout=120,
      check=False)
  assert proc.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, proc.stderr
  assert "collected no tests" in proc.stderr


@pytest.mark.skipif(not _under_bazel(), reason="checks the Bazel test env")
def test_bazel_runs_the_project_venv():
  """`.bazelrc` + .ci/run must select the venv's Python, not another one."""
  import jax  # pylint: disable=g-import-not-at-top
  import sao_jax  # pylint: disable=g-import-not-at-top
  assert jax.__version__
  # The package comes from the runfiles tree, not the venv's editable install.
  assert pathlib.Path(sao_jax.__file__).parent == _repo_root() / "sao_jax"
  assert sys.prefix != sys.base_prefix, f"not a venv: {sys.executable}"
  first_on_path = os.environ["PATH"].split(os.pathsep)
  first_on_path = [p for p in first_on_path if p not in ("", ".")][0]
  assert pathlib.Path(sys.executable).parent == pathlib.Path(first_on_path), (
      f"{sys.executable} is not the venv on PATH ({os.environ['PATH']})")
