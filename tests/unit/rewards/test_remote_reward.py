"""megarl.rewards.remote through RewardManager against a real HTTP service on loopback (tests/reward_service.py):
batching, the concurrency bound, retries of slow / failing / malformed answers, and the on_error policy
for what still fails."""

from __future__ import annotations

import pytest

from megarl.config import ConfigError
from megarl.run_config import load_config
from megarl.rewards import RewardError, RewardManager
from megarl.rewards.remote import RemoteRewardClient
from tests.reward_service import RewardService, reference_score

SAMPLES = 10


def batch(n: int = SAMPLES):
    responses = [f"the answer is {i % 3}" for i in range(n)]
    return dict(data_sources=["svc"] * n, solution_strs=responses, ground_truths=["1"] * n,
                extra_infos=[{"i": i} for i in range(n)], prompt_strs=[f"question {i}" for i in range(n)])


def manager(url: str, *, on_error: str = "fail", max_error_fraction: float = 0.5, **client) -> RewardManager:
    options = dict(batch_size=3, max_concurrency=2, timeout_s=0.3, max_retries=2, backoff_s=0.01) | client
    return RewardManager(remote=RemoteRewardClient(url, **options), on_error=on_error,
                         max_error_fraction=max_error_fraction)


def expected_scores(n: int = SAMPLES) -> list[float]:
    b = batch(n)
    return [reference_score({"response": r, "ground_truth": g}) for r, g in zip(b["solution_strs"], b["ground_truths"])]


def test_scores_come_back_in_order_in_bounded_concurrent_requests():
    # the service answers requests in pairs (rendezvous): concurrency shows without a race against the clock
    with RewardService(rendezvous=2) as service:
        result = manager(service.url, timeout_s=30).score_batch(**batch())
    assert result.scores.tolist() == expected_scores() and 0 < sum(expected_scores()) < SAMPLES
    assert sorted(len(r) for r in service.requests) == [1, 3, 3, 3]
    assert service.max_in_flight == 2  # concurrent, and never more than max_concurrency
    sent = {s["extra_info"]["i"]: s for r in service.requests for s in r}
    assert sent[4] == {"prompt": "question 4", "response": "the answer is 1", "ground_truth": "1",
                       "data_source": "svc", "extra_info": {"i": 4}}
    assert result.metrics["reward/remote/requests"] == 4 and result.metrics["reward/remote/retries"] == 0
    assert result.metrics["reward/num_errors"] == 0


@pytest.mark.parametrize("trouble", ["500", "slow", "bad_json", "short"])
def test_a_passing_trouble_is_retried(trouble):
    with RewardService(plan=[trouble, trouble], slow_s=0.6) as service:
        result = manager(service.url, max_concurrency=1).score_batch(**batch())
    assert result.scores.tolist() == expected_scores()
    assert result.metrics["reward/remote/retries"] == 2


@pytest.mark.parametrize("trouble,cause", [("500", "HTTP 500"), ("bad_json", "not JSON"),
                                           ("short", "2 scores for 3 samples"), ("slow", "timed out")])
def test_persistent_trouble_fails_with_the_url_and_cause(trouble, cause):
    with RewardService(default=trouble, slow_s=0.6) as service:
        with pytest.raises(RewardError) as error:
            manager(service.url, max_retries=1, max_concurrency=1).score_batch(**batch(3))  # one request's worth
    message = str(error.value)
    assert service.url in message and cause in message and "after 2 attempts" in message, message
    assert "sample 0" in message and "data_source='svc'" in message


def test_on_error_zero_scores_failed_requests_0_and_counts_them():
    # requests go out one at a time; the first request's three attempts fail, every later request succeeds
    with RewardService(plan=["500", "500", "500"]) as service:
        result = manager(service.url, on_error="zero", max_concurrency=1).score_batch(**batch())
    expected = expected_scores()
    assert result.scores.tolist() == [0.0, 0.0, 0.0] + expected[3:]
    assert result.metrics["reward/num_errors"] == 3
    assert "HTTP 500" in result.extra_infos[0]["reward_error"]


def test_a_client_error_is_not_retried():
    with RewardService(default="400") as service:
        with pytest.raises(RewardError, match="HTTP 400 .not retried."):
            manager(service.url, max_concurrency=1).score_batch(**batch(3))
    assert len(service.requests) == 1


def test_remote_config_is_checked():
    with pytest.raises(ConfigError, match="reward_model.remote.url must be an http"):
        load_config(overrides=["reward_model.remote.url=ftp://x"])
    with pytest.raises(ConfigError, match="reward_model.remote.max_concurrency"):
        load_config(overrides=["reward_model.remote.url=http://127.0.0.1:1/x", "reward_model.remote.max_concurrency=0"])
    with pytest.raises(ConfigError, match="set one"):
        load_config(overrides=["reward_model.remote.url=http://127.0.0.1:1/x",
                               "reward_model.custom_function.path=a.py"])
