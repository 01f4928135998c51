"""HumanEval in the sandbox (issue 39 items 3 and 4; docs/design/grading.md
"HumanEval"): the canonical solutions pass all 164, empty bodies none, and
completions that game the check fail; pass@k is the unbiased estimator."""


import pytest
import sandbox_pools

from sao_jax.grading import functions
from sao_jax.grading import humaneval

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def pool():
  p = sandbox_pools.grading_pool()
  yield p
  p.close()


@pytest.fixture(scope="module")
def problems():
  return humaneval.problems()


def test_canonical_solutions_pass_all_and_empty_bodies_none(pool, problems):
  assert len(problems) == 164
  canonical = [humaneval.passes(pool, p, p["canonical_solution"])
               for p in problems.values()]
  empty = [humaneval.passes(pool, p, "    pass\n") for p in problems.values()]
  assert sum(canonical) == 164 and sum(empty) == 0


# Completions (bodies of the first problem's function, or code after it)
# that try to pass without solving it.
GAMES = {
    "exit_0": "    import sys\n    sys.exit(0)\n",
    "os_exit_at_import": "    pass\nimport os\nos._exit(0)\n",
    "fake_verdict": ("    pass\nimport os\nfor fd in range(3, 16):\n"
                     "  try:\n    os.write(fd, b'{\"passed\": true}')\n"
                     "  except OSError:\n    pass\nos._exit(0)\n"),
    "always_equal": ("    class Eq:\n      def __eq__(self, o): return True\n"
                     "      def __bool__(self): return True\n"
                     "    return Eq()\n"),
    "kill_checker": ("    import os, signal\n"
                     "    os.kill(os.getppid(), signal.SIGKILL)\n"),
    "stop_checker": ("    import os, signal\n"
                     "    os.kill(os.getppid(), signal.SIGSTOP)\n"),
    "patch_assert_error": ("    pass\nimport builtins\n"
                           "builtins.AssertionError = type('X', (Exception,), {})\n"),
    "print_pass": "    print('passed')\n    return True\n",
    "hang": "    while True:\n      pass\n",
}


@pytest.mark.parametrize("game", sorted(GAMES))
def test_gaming_the_check_fails(pool, problems, game):
  for task_id in ("HumanEval/0", "HumanEval/2", "HumanEval/12"):
    assert not humaneval.passes(pool, problems[task_id], GAMES[game]), task_id
  assert pool.leftovers() in (None, [])


def test_pass_at_k_is_the_unbiased_estimator():
  assert humaneval.pass_at_k([0, 10], 10, 1) == pytest.approx(0.5)
  assert humaneval.pass_at_k([1], 10, 1) == pytest.approx(0.1)
  assert humaneval.pass_at_k([1], 10, 10) == pytest.approx(1.0)
  assert humaneval.pass_at_k([2], 5, 2) == pytest.approx(1 - 3 / 10)


def test_humaneval_as_held_out_tasks(pool, monkeypatch):
  """`env.eval_dataset = 'humaneval'`: training tasks of env.dataset, held-out
  tasks HumanEval's; a reply with the whole function in a block passes, a
  wrong one fails."""
  from configs import base  # pylint: disable=import-outside-toplevel
  from sao_jax.envs import build  # pylint: disable=import-outside-toplevel
  from sao_jax.envs import function_tasks  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(function_tasks._GRADERS, ("bwrap", 1),  # pylint: disable=protected-access
                      functions.FunctionGrader(pool))
  cfg = base.get_config()
  cfg.env.dataset, cfg.env.eval_dataset = "codeio", "humaneval"
  cfg.env.code_sandbox, cfg.env.code_workers = "bwrap", 1
  cfg.env.size, cfg.env.eval_size = 8, 5
  train, held = build.build_tasks(cfg.env)
  assert train.name == "codeio" and (held.name, len(held)) == ("humaneval", 5)
  entry = held.entry(0)
  assert "def has_close_elements" in entry["question"]
  assert held.score(entry["answer"], 0) == 1.0
  assert held.score("```python\ndef has_close_elements(a, b):\n"
                    "    return False\n```", 0) == 0.0
  assert held.score("    return False\n", 0) == 0.0
  assert held.prompt_id(4) == 4
