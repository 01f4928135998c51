"""Bazel `main` for every `py_test` in BUILD: runs pytest on the given files.

Each test target in the top-level BUILD passes its own test file as the argument,
e.g. `tests/pytest_main.py tests/models/test_models.py`. Bazel runs the test with the
runfiles tree of the target as working directory, so the paths are relative to it,
and only the files the target declares (its `srcs`, `deps` and `data`) exist there:
a missing `deps` entry shows up as an ImportError instead of silently importing the
source checkout.

Bazel's test protocol is honoured: results go to `$XML_OUTPUT_FILE` (JUnit XML),
`--test_filter=EXPR` becomes `pytest -k EXPR`, `$HOME` and caches point into
`$TEST_TMPDIR`. Pytest's exit code 5 (no test collected) is reported as a failure.
"""

from collections.abc import Sequence
import os
import pathlib
import sys

import pytest


def _point_caches_at_test_tmpdir(tmpdir: pathlib.Path) -> None:
  """Keeps HOME-relative caches (matplotlib, XDG users) inside the sandbox."""
  os.environ.setdefault("HOME", str(tmpdir))
  os.environ.setdefault("MPLCONFIGDIR", str(tmpdir / "matplotlib"))
  os.environ.setdefault("XDG_CACHE_HOME", str(tmpdir / "cache"))


def _drop_resolved_script_dir() -> None:
  """Removes the symlink-resolved `tests/` dir of the checkout from sys.path.

  Python puts the *resolved* directory of the main script first on sys.path,
  i.e. the source checkout rather than the runfiles tree; nothing may be imported
  from there.
  """
  script_dir = os.path.dirname(os.path.realpath(__file__))
  if sys.path and os.path.realpath(sys.path[0]) == script_dir:
    runfiles_dir = os.path.dirname(os.path.abspath(__file__))
    if runfiles_dir != script_dir:
      del sys.path[0]


def pytest_args(test_files: Sequence[str],
                env: dict[str, str]) -> list[str]:
  """Builds the pytest command line for `test_files` from Bazel's test env."""
  # `-n 0`: Bazel runs the test targets in parallel already (pytest.ini
  # asks for two pytest-xdist workers).
  args = ["-p", "no:cacheprovider", "-c", "pytest.ini", "--rootdir", ".", "-q",
          "-n", "0"]
  if env.get("XML_OUTPUT_FILE"):
    args += ["--junitxml", env["XML_OUTPUT_FILE"]]
  if env.get("TESTBRIDGE_TEST_ONLY"):
    args += ["-k", env["TESTBRIDGE_TEST_ONLY"]]
  return args + list(test_files)


def main(argv: Sequence[str]) -> int:
  """Runs pytest on the test files in `argv[1:]`; returns the exit status."""
  if len(argv) < 2:
    sys.stderr.write("usage: pytest_main.py TEST_FILE.py [PYTEST_ARGS...]\n")
    return 2
  _drop_resolved_script_dir()
  if os.environ.get("TEST_TMPDIR"):
    _point_caches_at_test_tmpdir(pathlib.Path(os.environ["TEST_TMPDIR"]))
  status = pytest.main(pytest_args(argv[1:], dict(os.environ)))
  if status == pytest.ExitCode.NO_TESTS_COLLECTED:
    sys.stderr.write(
        f"pytest collected no tests from {' '.join(argv[1:])}: an empty or "
        "mis-named test file is a failure (exit 5). Check the file's test "
        "names or remove its py_test target from BUILD.\n")
  return int(status)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
