"""GSM8K answer extraction and scoring.

strict:   the number after the last `#### ` marker (the GSM8K reference format);
flexible: the last number anywhere in the response.
Numbers compare numerically after removing `,` and `$` (so "$1,000.00" == "1000"). A ground truth that is a
full GSM8K solution ("... #### 72") is reduced to its final answer first.
Leaves out: word numbers ("seventy-two") and expressions; GSM8K answers are plain numbers.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from megarl.rewards.boxed_math import UNICODE_MINUS

_NUMBER = r"-?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def extract_gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """The answer string (unnormalised) or None when none is found. A Unicode minus counts as '-'."""
    text = text.translate(UNICODE_MINUS)
    if method == "strict":
        matches = _STRICT.findall(text)
    elif method == "flexible":
        matches = _ANY_NUMBER.findall(text)
    else:
        raise ValueError(f"gsm8k extraction method must be 'strict' or 'flexible', got {method!r}")
    return matches[-1] if matches else None


def parse_gsm8k_number(text: str) -> Decimal | None:
    cleaned = text.replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def score_gsm8k(
    solution_str: str, ground_truth: str, *, method: str = "strict", format_score: float = 0.0, score: float = 1.0
) -> float:
    """`score` if the extracted answer equals the ground truth, `format_score` if an answer was extracted but is
    wrong, 0 if there is no answer."""
    truth_text = extract_gsm8k_answer(ground_truth, "strict") if "####" in ground_truth else ground_truth
    truth = parse_gsm8k_number(truth_text or "")
    if truth is None:
        raise ValueError(f"gsm8k ground truth is not a number: {ground_truth!r}")
    answer = extract_gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    value = parse_gsm8k_number(answer)
    return score if value is not None and value == truth else format_score
