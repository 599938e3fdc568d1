"""MATH-style scoring: extract the last `\\boxed{...}` (or `\\fbox{...}`) answer, normalise, compare.

Normalisation removes what does not change the answer: spaces, `\\left`/`\\right`, `\\!` and other spacing,
`dfrac`/`tfrac` -> `frac`, degree and percent signs, `$`, a trailing `.`, trailing units written as `\\text{ cm}`,
a leading `x =` (a left side of at most 2 characters, so `y=2x+1` also compares as `2x+1`); it rewrites
`\\frac12` -> `\\frac{1}{2}`, `a/b` -> `\\frac{a}{b}`, `.5` -> `0.5`. Two answers are equal if
their normalised strings match, or if both parse as plain rationals (`0.5`, `\\frac{1}{2}`, `1/2`, `-3`) with
the same value.
Leaves out: symbolic equivalence (sympy), intervals/sets in different orders, matrices.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def extract_last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}` with balanced braces, `\\boxed 5` form too; None if
    there is none or its braces never close."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    rest = text[start + len(cmd):]
    if rest.startswith(" "):  # "\boxed 5$": the argument runs to the next `$` or whitespace
        return re.split(r"[\s$]", rest.lstrip(), maxsplit=1)[0] or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def _fix_fracs(s: str) -> str:
    # "\frac12" -> "\frac{1}{2}", "\frac1{2}" -> "\frac{1}{2}"
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


# Minus signs that are not ASCII: U+2212 (the typeset minus), U+FE63 (small), U+FF0D (fullwidth).
UNICODE_MINUS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})


def normalize_math_answer(answer: str) -> str:
    s = answer.strip().translate(UNICODE_MINUS)
    s = s.replace("\n", "").replace("\\!", "")
    for spacing in ("\\,", "\\;", "\\:", "\\quad", "\\qquad"):
        s = s.replace(spacing, "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("dfrac", "frac").replace("tfrac", "frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\degree", "")
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    # trailing units: "5 \text{ cm}" -> "5"; a whole-answer "\text{(A)}" is unwrapped instead
    s = re.sub(r"^(.+?)\s*\\(?:text|mbox|mathrm)\{\s*[a-zA-Z ]+\}(\^\d)?$", r"\1", s)
    s = re.sub(r"\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}", r"\1", s)
    s = s.replace(" ", "")
    s = s.rstrip(".")
    # "x=5" / "k=5" -> "5", but keep real equations such as "y=2x+1" (long left side)
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = _fix_fracs(s)
    if re.fullmatch(r"-?\d+/\d+", s):
        num, den = s.lstrip("-").split("/")
        s = ("-" if s.startswith("-") else "") + f"\\frac{{{num}}}{{{den}}}"
    s = re.sub(r"(^|[^\d])\.(\d)", r"\g<1>0.\2", s)
    return s


def _as_fraction(s: str) -> Fraction | None:
    """Value of a plain rational written as an integer, decimal or \\frac{a}{b} (optionally negative)."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(\.\d+)?", s.replace(",", "")):
            return Fraction(s.replace(",", ""))
    except ZeroDivisionError:
        return None
    return None


def math_answers_equal(prediction: str, truth: str) -> bool:
    a, b = normalize_math_answer(prediction), normalize_math_answer(truth)
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    return fa is not None and fa == fb


def _reference_answer(ground_truth: str) -> str:
    """The ground truth's answer: a MATH solution containing ``\\boxed`` is reduced to its boxed answer."""
    truth = extract_last_boxed(ground_truth) if any(c in ground_truth for c in _BOX_COMMANDS) else ground_truth
    if truth is None:
        raise ValueError(f"math ground truth has an unbalanced \\boxed: {ground_truth!r}")
    return truth


def score_boxed_math(solution_str: str, ground_truth: str, *, score: float = 1.0) -> float:
    """`score` if the last boxed answer of the response equals the ground truth, else 0. A ground truth that
    itself contains `\\boxed` (a MATH solution) is reduced to its boxed answer."""
    truth = _reference_answer(ground_truth)
    prediction = extract_last_boxed(solution_str)
    if prediction is None:
        return 0.0
    return score if math_answers_equal(prediction, truth) else 0.0


_ANSWER_LINE = re.compile(r"(?im)^[ \t*#>]*answer[ \t*]*[:\uff1a][ \t*]*(.+?)[ \t*]*$")


def extract_answer_line(text: str) -> tuple[int, str] | None:
    """(position, answer) of the last line ``Answer: ...`` (DAPO's format; case-insensitive, markdown bold
    and a full-width colon allowed), or None. A ``\\boxed{}`` inside the line is unwrapped."""
    matches = list(_ANSWER_LINE.finditer(text))
    if not matches:
        return None
    answer = matches[-1].group(1)
    boxed = extract_last_boxed(answer)
    return matches[-1].start(), (boxed if boxed is not None else answer).strip().rstrip(".")


def score_math_answer(solution_str: str, ground_truth: str, *, score: float = 1.0) -> float:
    """Like :func:`score_boxed_math`, but the response's answer may also be a final ``Answer: ...`` line (what
    DAPO's prompt asks for): whichever of the last ``\\boxed{}`` and the last answer line comes later."""
    truth = _reference_answer(ground_truth)
    line = extract_answer_line(solution_str)
    boxed_at = max(solution_str.rfind(cmd) for cmd in _BOX_COMMANDS)
    if line is not None and line[0] > boxed_at:
        prediction = line[1]
    else:
        prediction = extract_last_boxed(solution_str)
    if prediction is None:
        return 0.0
    return score if math_answers_equal(prediction, truth) else 0.0
