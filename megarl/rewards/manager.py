"""Score a batch of decoded responses: route each sample to its scorer, enforce the error policy, report metrics.

`RewardManager.score_batch` is sequential (the "naive" manager): one Python call per sample. A custom reward
function, when given, scores every sample (`fn(data_source, solution_str, ground_truth, extra_info)`); otherwise
the data_source picks a built-in scorer (`routing.py`). A scorer result must be a finite number, or a dict with
a finite number under "score" whose other entries travel as per-sample extra info (numeric ones also as metrics).

Error policy: `on_error="fail"` raises `RewardError` naming the sample, data_source, scorer and the cause;
`on_error="zero"` scores the sample 0, records the message in its extra info, counts it in
`reward/num_errors` and warns on stderr with the batch's first error; a batch where more than
`max_error_fraction` of the samples failed raises `RewardError` all the same (a scorer that fails everywhere is
a broken scorer, not noise). An unknown data_source is a configuration error and always raises.
With a remote reward service (:mod:`megarl.rewards.remote`, ``reward_model.remote.url``) the service scores
every sample instead (with its prompt); a request that still fails after its retries is each of its samples'
error, under the same policy. Leaves out: decoding token ids to text, and model-based rewards (a reward model,
an LLM judge), which :mod:`megarl.trainer.scoring` combines with these scores.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from megarl.rewards.remote import RemoteRewardClient, RemoteRewardError
from megarl.rewards.routing import ScorerFn, ScorerRouter

ON_ERROR_POLICIES = ("fail", "zero")


class RewardError(RuntimeError):
    """A scorer raised or returned something that is not a finite score."""


@dataclass
class RewardResult:
    scores: torch.Tensor  # [B] float32
    extra_infos: list[dict]  # per sample: extra keys of dict results, "reward_error" for zeroed failures
    metrics: dict[str, float]


def _as_finite_score(value) -> float:
    """float(value) for a finite real number; raise ValueError otherwise (strings, None, NaN, inf)."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        raise ValueError(f"score must be a number, got {type(value).__name__} {value!r}")
    score = float(value)
    if not math.isfinite(score):
        raise ValueError(f"score must be finite, got {score}")
    return score


def _split_result(result) -> tuple[float, dict]:
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"a dict result must have a 'score' key, got keys {sorted(result)}")
        extras = {k: v for k, v in result.items() if k != "score"}
        return _as_finite_score(result["score"]), extras
    return _as_finite_score(result), {}


class RewardManager:
    """Sequential batch scorer; see the module docstring for routing and the error policy."""

    def __init__(
        self,
        *,
        custom_fn: Callable[[str, str, str, dict], object] | None = None,
        routes: Mapping[str, str | ScorerFn] | None = None,
        on_error: str = "fail",
        max_error_fraction: float = 0.5,
        remote: RemoteRewardClient | None = None,
    ):
        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"on_error must be one of {ON_ERROR_POLICIES}, got {on_error!r}")
        if not 0.0 <= max_error_fraction <= 1.0:
            raise ValueError(f"max_error_fraction must be in [0, 1], got {max_error_fraction}")
        if remote is not None and custom_fn is not None:
            raise ValueError("reward_model.remote.url and reward_model.custom_function.path both score every "
                             "sample: set one")
        self.custom_fn = custom_fn
        self.remote = remote
        self.router = ScorerRouter(routes)
        self.on_error = on_error
        self.max_error_fraction = max_error_fraction

    def _scorer_name(self, data_source: str) -> str:
        if self.remote is not None:
            return f"remote:{self.remote.url}"
        if self.custom_fn is not None:
            return f"custom:{getattr(self.custom_fn, '__qualname__', repr(self.custom_fn))}"
        return self.router.scorer_name(data_source)

    def _score_one(self, data_source: str, solution_str: str, ground_truth, extra_info: dict):
        if self.custom_fn is not None:
            return self.custom_fn(data_source, solution_str, ground_truth, extra_info)
        return self.router.scorer_for(data_source)(solution_str, ground_truth)

    def score_batch(
        self,
        data_sources: Sequence[str],
        solution_strs: Sequence[str],
        ground_truths: Sequence,
        extra_infos: Sequence[dict | None] | None = None,
        prompt_strs: Sequence[str] | None = None,
    ) -> RewardResult:
        """``prompt_strs``: the prompts' text, which a remote reward service receives with each response."""
        batch = len(solution_strs)
        extra_infos = [None] * batch if extra_infos is None else list(extra_infos)
        prompt_strs = [""] * batch if prompt_strs is None else list(prompt_strs)
        for field, values in (("data_sources", data_sources), ("ground_truths", ground_truths),
                              ("extra_infos", extra_infos), ("prompt_strs", prompt_strs)):
            if len(values) != batch:
                raise ValueError(f"{field} has {len(values)} entries but solution_strs has {batch}")
        if self.custom_fn is None and self.remote is None:
            for i, source in enumerate(data_sources):
                self.router.check_known(source, index=i)
        remote = None
        if self.remote is not None:
            remote = self.remote.score([
                {"prompt": prompt_strs[i], "response": solution_strs[i], "ground_truth": ground_truths[i],
                 "data_source": data_sources[i], "extra_info": extra_infos[i] or {}} for i in range(batch)])

        scores: list[float] = []
        per_sample: list[dict] = []
        num_errors = 0
        first_error = ""
        for i in range(batch):
            source = data_sources[i]
            try:
                if remote is not None:
                    if remote.errors[i] is not None:
                        raise RemoteRewardError(remote.errors[i])
                    result = remote.scores[i]
                else:
                    result = self._score_one(source, solution_strs[i], ground_truths[i], extra_infos[i] or {})
                score, extras = _split_result(result)
            except Exception as exc:  # any scorer failure is reported with its sample, never swallowed silently
                message = (
                    f"reward scoring failed for sample {i} (data_source={source!r}, "
                    f"scorer={self._scorer_name(source)}): {type(exc).__name__}: {exc}"
                )
                if self.on_error == "fail":
                    raise RewardError(message) from exc
                num_errors += 1
                first_error = first_error or message
                score, extras = 0.0, {"reward_error": message}
            scores.append(score)
            per_sample.append(extras)
        if num_errors:
            summary = (f"{num_errors} of {batch} samples failed to score (reward_model.on_error=zero scored them 0); "
                       f"first: {first_error}")
            if num_errors > self.max_error_fraction * batch:
                raise RewardError(f"{summary}; that is more than reward_model.max_error_fraction="
                                  f"{self.max_error_fraction} of the batch")
            print(f"[megarl] warning: {summary}", file=sys.stderr, flush=True)

        metrics = _summarise(data_sources, scores, per_sample, num_errors)
        if remote is not None:
            metrics.update({"reward/remote/requests": float(remote.requests),
                            "reward/remote/retries": float(remote.retries)})
        return RewardResult(scores=torch.tensor(scores, dtype=torch.float32), extra_infos=per_sample, metrics=metrics)


def mean_by_source(data_sources: Sequence[str], scores: Sequence[float]) -> dict[str, float]:
    """The mean score of each data_source's samples, in order of first appearance."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, score in zip(data_sources, scores):
        by_source[source].append(float(score))
    return {source: sum(values) / len(values) for source, values in by_source.items()}


def _summarise(data_sources, scores, per_sample, num_errors) -> dict[str, float]:
    metrics: dict[str, float] = {"reward/num_errors": float(num_errors)}
    if scores:
        metrics["reward/mean_score"] = sum(scores) / len(scores)
    for source, mean in mean_by_source(data_sources, scores).items():
        metrics[f"reward/{source}/mean_score"] = mean
    by_key: dict[str, list[float]] = defaultdict(list)
    for extras in per_sample:
        for key, value in extras.items():
            if isinstance(value, (int, float)) and math.isfinite(value):  # bools count as 0/1 (e.g. "acc")
                by_key[key].append(float(value))
    for key, values in by_key.items():
        metrics[f"reward/extra/{key}/mean"] = sum(values) / len(values)
    return metrics


def place_scores_on_last_token(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """token_level_scores [B, T]: each sequence score at its last valid response token, 0 elsewhere."""
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be [B] and response_mask [B, T]; got {tuple(scores.shape)}, "
                         f"{tuple(response_mask.shape)}")
    valid = response_mask.bool()
    empty = (~valid.any(dim=-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} of response_mask have no valid token to put a score on")
    positions = torch.arange(response_mask.shape[1], device=response_mask.device)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).max(dim=-1).values
    token_scores = torch.zeros(response_mask.shape, dtype=torch.float32, device=response_mask.device)
    token_scores[torch.arange(scores.shape[0], device=response_mask.device), last] = scores.to(torch.float32)
    return token_scores
