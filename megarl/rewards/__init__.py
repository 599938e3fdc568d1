"""Rule-based rewards: gsm8k, boxed math and format scorers, custom reward loading, the batch reward manager.

Leaves out: model-based reward models; the synthetic task scorer lives with the data helper
(`megarl.rewards.synthetic_task`) and is only imported when a `synthetic/digits` sample is scored.
"""

from megarl.rewards.boxed_math import extract_last_boxed, math_answers_equal, normalize_math_answer, score_boxed_math
from megarl.rewards.custom import load_custom_reward_fn
from megarl.rewards.format_reward import THINK_THEN_ANSWER, score_format
from megarl.rewards.gsm8k import extract_gsm8k_answer, score_gsm8k
from megarl.rewards.manager import (RewardError, RewardManager, RewardResult, mean_by_source,
                                   place_scores_on_last_token)
from megarl.rewards.routing import DEFAULT_ROUTES, ScorerRouter, resolve_scorer

__all__ = [
    "DEFAULT_ROUTES",
    "THINK_THEN_ANSWER",
    "RewardError",
    "RewardManager",
    "RewardResult",
    "ScorerRouter",
    "extract_gsm8k_answer",
    "extract_last_boxed",
    "load_custom_reward_fn",
    "math_answers_equal",
    "mean_by_source",
    "normalize_math_answer",
    "place_scores_on_last_token",
    "resolve_scorer",
    "score_boxed_math",
    "score_format",
    "score_gsm8k",
]
