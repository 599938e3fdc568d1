"""gsm8k, boxed-math and format scorers on real response strings."""

import pytest

from megarl.rewards import (
    extract_gsm8k_answer,
    extract_last_boxed,
    normalize_math_answer,
    score_boxed_math,
    score_format,
    score_gsm8k,
)

GSM8K_SOLUTION = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)


def test_gsm8k_strict():
    assert score_gsm8k("She sold 24 in May, so 48 + 24 = 72.\n#### 72", "72") == 1.0
    assert score_gsm8k("#### $1,000.00", "1000") == 1.0
    assert score_gsm8k("#### 71", "72") == 0.0
    assert score_gsm8k("#### 71", "72", format_score=0.1) == 0.1
    assert score_gsm8k("The answer is 72.", "72", format_score=0.1) == 0.0  # no marker: no answer in strict
    assert score_gsm8k("#### 70 wait\n#### 72", "72") == 1.0  # the last marker wins
    assert score_gsm8k("#### -3", "-3") == 1.0


def test_gsm8k_flexible_and_full_solution_ground_truth():
    assert score_gsm8k("So the total is 1,250 dollars.", "1250", method="flexible") == 1.0
    assert score_gsm8k("Step 1: 3 apples. Step 2: 5 apples.", "3", method="flexible") == 0.0
    assert score_gsm8k("#### 72", GSM8K_SOLUTION) == 1.0
    assert extract_gsm8k_answer("no numbers here", "flexible") is None
    with pytest.raises(ValueError, match="'strict' or 'flexible'"):
        extract_gsm8k_answer("#### 1", "fuzzy")
    with pytest.raises(ValueError, match="not a number"):
        score_gsm8k("#### 1", "seventy")


def test_extract_last_boxed_balanced():
    assert extract_last_boxed(r"first \boxed{1} then \boxed{\frac{a}{b^{2}}} done") == r"\frac{a}{b^{2}}"
    assert extract_last_boxed(r"\fbox{42}") == "42"
    assert extract_last_boxed(r"so $\boxed 7$.") == "7"
    assert extract_last_boxed(r"\boxed{unclosed {") is None
    assert extract_last_boxed("no box") is None


@pytest.mark.parametrize(
    "response,truth",
    [
        (r"Thus $\boxed{\dfrac{1}{2}}$.", "0.5"),
        (r"\boxed{1/2}", r"\frac12"),
        (r"\boxed{\frac{2}{4}}", "0.5"),
        (r"The answer is $\boxed{x = 5}$.", "5"),
        (r"\fbox{10\text{ cm}}", "10"),
        (r"\boxed{\left( 3, 4 \right)}", "(3,4)"),
        (r"\boxed{90^\circ}", "90"),
        (r"\boxed{\text{(A)}}", "(A)"),
        (r"\boxed{\sqrt2}", r"\sqrt{2}"),
        (r"\boxed{.75}", r"\frac{3}{4}"),
        (r"\boxed{5.}", "5"),
        (r"\boxed{12\%}", "12"),
        (r"\boxed{3}", r"The sum is $\boxed{3}$."),  # MATH-style solution as ground truth
    ],
)
def test_boxed_math_equivalences(response, truth):
    assert score_boxed_math(response, truth) == 1.0


@pytest.mark.parametrize(
    "response,truth",
    [
        (r"\boxed{3}", "4"),
        (r"\boxed{\frac{1}{3}}", "0.33"),
        ("the answer is 5", "5"),  # no box: no answer
        (r"\boxed{x=5}", "6"),
        (r"\boxed{\frac{1}{0}}", "0"),
    ],
)
def test_boxed_math_negatives(response, truth):
    assert score_boxed_math(response, truth) == 0.0


def test_normalize_examples():
    assert normalize_math_answer(r" \left[ 1, 2 \right] ") == "[1,2]"
    assert normalize_math_answer(r"\!3\,000") == "3000"


def test_format_reward():
    assert score_format("<think>add 2 and 2</think> The answer is 4.") == 1.0
    assert score_format("<think>\nline1\nline2\n</think>\n4") == 1.0
    assert score_format("The answer is 4.") == 0.0
    assert score_format("<think>unfinished reasoning") == 0.0
    assert score_format("<think>only thinking</think>   ") == 0.0
    assert score_format("Answer: 4", pattern=r"^Answer: \d+$", score=0.5) == 0.5
