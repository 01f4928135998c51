"""The online-learning simulation's evolving environment (docs/design/envs.md
"Online-learning simulation").

Reward = r_quality x r_style in {0, 1}. r_quality = 1 iff the task's scorer
gives full credit to the unwrapped answer; r_style = 1 iff the answer uses the
style required *now*. The required style switches on a schedule of policy
versions: with `styles=(s0, s1, s2)` and `switch_at=(100, 200)`, versions
< 100 require s0, 100..199 require s1, >= 200 require s2. The version is the
one of the policy that produced the answer (`set_policy_version`, called by
the episode runner before every step).

Styles (`final_answer` text, whole string):
  'boxed':      \\boxed{ANSWER}
  'answer_tag': <answer>ANSWER</answer>
  'plain':      ANSWER with neither wrapper
With `answer='last_number'` (a chatty instruct model, `config.env.answer`)
the answer is the reply's last number and its style the wrapper around it
(`parse_style_last_number`): "So 3 + 4 = \\boxed{7}." is 'boxed' 7.
"""

from __future__ import annotations

import bisect
import re
from typing import Any, Sequence

from sao_jax.envs import answers
from sao_jax.envs.base import final_answer
from sao_jax.envs.base import StepResult
from sao_jax.envs.reasoning_gym_env import ReasoningGymEnv
from sao_jax.envs.reasoning_gym_env import ReasoningGymTasks

_WRAPPERS = {
    "boxed": re.compile(r"\\boxed\{(.*)\}", re.DOTALL),
    "answer_tag": re.compile(r"<answer>(.*)</answer>", re.DOTALL),
}
STYLES = ("boxed", "answer_tag", "plain")


def parse_style(answer: str) -> tuple[str, str]:
  """(style, unwrapped answer) of a final answer string."""
  for style, pattern in _WRAPPERS.items():
    m = pattern.fullmatch(answer)
    if m:
      return style, m.group(1).strip()
  return "plain", answer


_LAST_WRAPPERS = {
    "boxed": re.compile(r"\\boxed\{([^{}]*)\}"),
    "answer_tag": re.compile(r"<answer>(.*?)</answer>", re.DOTALL),
}
EVOLVING_ANSWER_RULES = ("whole", "last_number")


def parse_style_last_number(reply: str) -> tuple[str, str]:
  """(style, last number) of a chatty reply: 'boxed' / 'answer_tag' when the
  reply's last number lies inside a \\boxed{} / <answer></answer>, else
  'plain'; ("plain", "") without a number."""
  span = answers.last_number_span(reply)
  if span is None:
    return "plain", ""
  number = answers.last_number(reply)
  for style, pattern in _LAST_WRAPPERS.items():
    if any(m.start(1) <= span[0] and span[1] <= m.end(1)
           for m in pattern.finditer(reply)):
      return style, number
  return "plain", number


def format_style(answer: str, style: str) -> str:
  """``answer`` written in ``style`` (the inverse of ``parse_style``)."""
  if style == "boxed":
    return f"\\boxed{{{answer}}}"
  if style == "answer_tag":
    return f"<answer>{answer}</answer>"
  if style == "plain":
    return answer
  raise ValueError(f"Unknown style {style!r}; choose from {STYLES}.")


def required_style(version: int, styles: Sequence[str],
                   switch_at: Sequence[int]) -> str:
  """The style required at policy `version` (see module doc)."""
  return styles[bisect.bisect_right(list(switch_at), version)]


class EvolvingEnv(ReasoningGymEnv):
  """Single turn; the reward's required answer style changes with versions."""

  def __init__(self, tasks: ReasoningGymTasks,
               styles: Sequence[str] = STYLES,
               switch_at: Sequence[int] = (100, 200), instruction: str = "",
               answer: str = "whole"):
    super().__init__(tasks, instruction)
    if answer not in EVOLVING_ANSWER_RULES:
      raise ValueError(
          f"env.answer={answer!r}: the evolving environment reads a whole "
          "wrapped answer ('whole') or the wrapper around the reply's last "
          f"number ('last_number'); choose from {EVOLVING_ANSWER_RULES}.")
    self.answer_rule = answer
    self.styles, self.switch_at = tuple(styles), tuple(int(v) for v in switch_at)
    bad = [s for s in self.styles if s not in STYLES]
    if bad:
      raise ValueError(f"Unknown styles {bad}; choose from {STYLES}.")
    if len(self.styles) != len(self.switch_at) + 1:
      raise ValueError(
          f"{len(self.styles)} styles need {len(self.styles) - 1} switch "
          f"points, got switch_at={self.switch_at}.")
    if list(self.switch_at) != sorted(set(self.switch_at)):
      raise ValueError(f"switch_at={self.switch_at} must strictly increase.")
    self.name = tasks.name + "+evolving"
    self._version = 0

  @classmethod
  def config_kwargs(cls, env_cfg: Any, reward: str | None) -> dict[str, Any]:
    # Its reward is its own (binary quality): no answer or reward rule.
    return {**super(ReasoningGymEnv, cls).config_kwargs(env_cfg, reward),
            "styles": tuple(env_cfg.styles),
            "switch_at": tuple(env_cfg.style_change_steps),
            "answer": env_cfg.get("answer", "whole")}

  def set_policy_version(self, version: int) -> None:
    self._version = int(version)

  def step(self, action_text: str) -> StepResult:
    index = self._require_episode()
    reply = final_answer(action_text, self.template)
    style, answer = (parse_style_last_number(reply)
                     if self.answer_rule == "last_number"
                     else parse_style(reply))
    want = required_style(self._version, self.styles, self.switch_at)
    r_quality = float(self.score(answer) >= 1.0)
    r_style = float(style == want)
    self._index = None
    return StepResult("", r_quality * r_style, True, {
        "answer": answer, "style": style, "required_style": want,
        "r_quality": r_quality, "r_style": r_style, "task_index": index})
