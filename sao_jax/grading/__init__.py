"""Grading code by hidden tests, in the sandbox (docs/design/grading.md).

The policy's code is what RL optimises against, so grading is built as if
the code were an attacker: expected outputs are computed by the trusted side
in its own sandbox call and never enter the candidate's; the candidate's
sandbox sees the standard library only (not the venv, where the task data
lives); the candidate's return values come back as JSON and are compared
on the host (`values.same`), never by code the candidate could patch.
"""
