"""Format reward: does the response follow a required layout (by default `<think>...</think>` then an answer)?

Leaves out: answer correctness; combine with a correctness scorer in a custom reward function.
"""

from __future__ import annotations

import re

THINK_THEN_ANSWER = r"^\s*<think>.+?</think>\s*\S.*$"


def score_format(
    solution_str: str, ground_truth: object = None, *, pattern: str = THINK_THEN_ANSWER, score: float = 1.0
) -> float:
    """`score` when the whole response matches `pattern` (regex, DOTALL: `.` spans lines), else 0.
    `ground_truth` is ignored; it is accepted so the scorer fits the router's (solution, truth) call."""
    return score if re.match(pattern, solution_str, flags=re.DOTALL) else 0.0
