"""Rule scorers for the synthetic tasks: digits (`data_source="synthetic/digits"`, see `megarl.data.synthetic`)
and shapes (`"synthetic/shapes"`, see `megarl.data.shapes_task`).

`score_digits(solution_str, ground_truth)` returns 1.0 for the exact answer and otherwise a partial credit
below 0.9, dense enough that a random-init policy gets a learning signal from its first rollouts:

    0.1 * (fraction of response characters that are digits)        -- "answer with digits only"
  + 0.1 * min(len) / max(len) of response and answer              -- "stop at the answer's length"
  + 0.7 * (positions where response and answer agree) / max(len)   -- "the right digit in the right place"

Dividing by the longer of the two lengths makes extra or missing characters cost credit, so the unique
maximum is the exact answer. The length term is there to teach a random policy to end its turn: in a quick
GRPO probe without it (tiny-qwen2, 8-token responses, lr 1e-3) the policy learned digits but kept every response
at the 8-token limit and the mean reward flattened near 0.12; with it (lr 3e-3) responses shrank to 2-3
characters and the mean reward went from 0.05 to ~0.25-0.3 within 45-65 steps.

`score_shapes` scores the same way against a one-word or one-number answer, which a response gives bare or as its
last ``\\boxed{}`` (a tokenizer without a backslash, the embedded one, can only give it bare); case is ignored.

Left out: any parsing of free-form reasoning; the answer is the whole response (or its last box).
"""

from __future__ import annotations

from megarl.rewards.boxed_math import extract_last_boxed

# Decoders that keep special tokens leave them in the text; they are not part of the answer.
_END_MARKERS = ("<|im_end|>", "<|endoftext|>")

# ASCII only: str.isdigit also accepts characters such as "²" that are no answer digit.
_DIGITS = frozenset("0123456789")
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyz")

FORMAT_WEIGHT = 0.1
LENGTH_WEIGHT = 0.1
ACCURACY_WEIGHT = 0.7


def score_digits(solution_str: str, ground_truth: str) -> float:
    """Score a response to a digits prompt in [0, 1]; 1.0 only for the exact answer, below 0.9 otherwise."""
    target = str(ground_truth).strip()
    if not target or any(ch not in _DIGITS for ch in target):
        raise ValueError(f"digits ground_truth must be a non-empty digit string, got {ground_truth!r}")
    return _closeness(_strip_end_markers(solution_str).strip(), target, _DIGITS)


def score_shapes(solution_str: str, ground_truth: str) -> float:
    """Score a response to a shapes question in [0, 1]; 1.0 only for the exact answer (bare or boxed)."""
    target = str(ground_truth).strip().lower()
    if not target or not (target.isascii() and (target.isalpha() or target.isdigit())):
        raise ValueError(f"shapes ground_truth must be one word or number, got {ground_truth!r}")
    response = _strip_end_markers(solution_str)
    boxed = extract_last_boxed(response)
    answer = (boxed if boxed is not None else response).strip().lower()
    return _closeness(answer, target, _DIGITS if target.isdigit() else _LETTERS)


def _closeness(response: str, target: str, answer_characters: frozenset) -> float:
    """1.0 for ``response == target``, otherwise the partial credit of the module docstring (below 0.9), with
    "digits" read as ``answer_characters``."""
    if response == target:
        return 1.0
    if not response:
        return 0.0
    format_fraction = sum(ch in answer_characters for ch in response) / len(response)
    longer = max(len(response), len(target))
    length_ratio = min(len(response), len(target)) / longer
    accuracy = sum(a == b for a, b in zip(response, target)) / longer
    return FORMAT_WEIGHT * format_fraction + LENGTH_WEIGHT * length_ratio + ACCURACY_WEIGHT * accuracy


def _strip_end_markers(text: str) -> str:
    # Cut at the first end marker: whatever a policy emits after its end-of-turn is not its answer.
    cut = len(text)
    for marker in _END_MARKERS:
        pos = text.find(marker)
        if pos != -1:
            cut = min(cut, pos)
    return text[:cut]
