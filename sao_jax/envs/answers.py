"""Answer extraction: the reply text -> the answer string the scorer sees.

One rule per run (`config.env.answer`), used by both the training reward and
the held-out accuracy (both score `extract(reply, rule)` with reasoning-gym's
`score_answer`):

- `whole`: the whole reply (after the last tool result, before the end of the
  turn, stripped; `base.final_answer`). Right for models trained to answer
  with the bare value (the from-scratch models after SFT).
- `last_number`: the last number in the reply (`-12`, `3.5`, `1,024` ->
  `1024`; a trailing sentence period is not part of it), or `""` if the reply
  has none. Instruct models are chatty ("The answer to this problem is 19.");
  SmolLM2-135M-Instruct scores 0.0 under `whole` and 0.47 under this rule on
  chain_sum (2 one-digit terms).
- `answer_tag`: the content of the last `<answer>...</answer>` in the reply
  (for prompts that ask for that tag), stripped; `""` if there is none.
- `answer_tag_or_last_number`: the tag when present, else the last number.
"""

from __future__ import annotations

import re

ANSWER_RULES = ("whole", "last_number", "answer_tag",
                "answer_tag_or_last_number")
# A signed integer or decimal, with optional thousands separators.
_NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def last_number_span(text: str) -> tuple[int, int] | None:
  """Where the last number of `text` is (start, end), or None."""
  found = list(_NUMBER_RE.finditer(text))
  return found[-1].span() if found else None


def last_number(text: str) -> str:
  """The last number in `text` without thousands separators, or ""."""
  span = last_number_span(text)
  return text[span[0]:span[1]].replace(",", "") if span else ""


def answer_tag(text: str) -> str:
  """The content of the last `<answer>...</answer>` in `text`, or ""."""
  found = _TAG_RE.findall(text)
  return found[-1].strip() if found else ""


def extract(reply: str, rule: str) -> str:
  """The answer in `reply` (already cut to the final turn) under `rule`."""
  if rule == "whole":
    return reply
  if rule == "last_number":
    return last_number(reply)
  if rule == "answer_tag":
    return answer_tag(reply)
  if rule == "answer_tag_or_last_number":
    return answer_tag(reply) or last_number(reply)
  raise ValueError(f"Unknown answer rule {rule!r}; expected one of "
                   f"{ANSWER_RULES} (config.env.answer).")
