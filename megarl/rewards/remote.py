"""Scores from a remote reward service over HTTP (``reward_model.remote.url``).

Protocol: ``POST <url>`` with JSON ``{"samples": [{"prompt", "response", "ground_truth", "data_source",
"extra_info"}, ...]}``; the answer is JSON ``{"scores": [number, ...]}``, one finite number per sample, in
order. A batch goes out in requests of at most ``batch_size`` samples, at most ``max_concurrency`` at a time.

A request that fails — connection error, timeout (``timeout_s`` per request), HTTP 429 or 5xx, a body that is
not that JSON, the wrong number of scores — is retried up to ``max_retries`` times with exponential backoff
(``backoff_s``, doubling); other 4xx answers are the caller's mistake and are not retried. What still fails
comes back as the error of each of its samples (:class:`RemoteScores`), for the reward manager's ``on_error``
policy to raise or zero. Leaves out: authentication beyond fixed headers, streaming, async clients.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence


class RemoteRewardError(RuntimeError):
    """One request to the reward service failed for good; the message names the url and the cause."""

    def __init__(self, message: str, *, attempts: int = 1):
        super().__init__(message)
        self.attempts = attempts


@dataclass
class RemoteScores:
    """Per sample: its score, or (score None) why its request failed."""

    scores: list[Optional[float]]
    errors: list[Optional[str]]
    requests: int
    retries: int


class _Retryable(Exception):
    pass


def check_remote_settings(*, url: str, batch_size: int, max_concurrency: int, timeout_s: float, max_retries: int,
                          backoff_s: float) -> None:
    """``ValueError`` naming the ``reward_model.remote`` key a client could not work with."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"reward_model.remote.url must be an http(s) URL, got {url!r}")
    for name, value in (("batch_size", batch_size), ("max_concurrency", max_concurrency)):
        if value < 1:
            raise ValueError(f"reward_model.remote.{name} must be >= 1, got {value}")
    if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
        raise ValueError("reward_model.remote: timeout_s must be > 0, max_retries and backoff_s >= 0 "
                         f"(got {timeout_s}, {max_retries}, {backoff_s})")


class RemoteRewardClient:
    def __init__(self, url: str, *, batch_size: int = 64, max_concurrency: int = 8, timeout_s: float = 30.0,
                 max_retries: int = 3, backoff_s: float = 0.5, headers: Optional[Mapping[str, str]] = None):
        check_remote_settings(url=url, batch_size=batch_size, max_concurrency=max_concurrency, timeout_s=timeout_s,
                              max_retries=max_retries, backoff_s=backoff_s)
        self.url, self.batch_size, self.max_concurrency = url, batch_size, max_concurrency
        self.timeout_s, self.max_retries, self.backoff_s = timeout_s, max_retries, backoff_s
        self.headers = {"Content-Type": "application/json", **dict(headers or {})}

    def score(self, samples: Sequence[Mapping[str, Any]]) -> RemoteScores:
        chunks = [list(range(start, min(start + self.batch_size, len(samples))))
                  for start in range(0, len(samples), self.batch_size)]
        scores: list[Optional[float]] = [None] * len(samples)
        errors: list[Optional[str]] = [None] * len(samples)
        retries = 0
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, max(len(chunks), 1)),
                                thread_name_prefix="reward-remote") as pool:
            futures = [pool.submit(self._post_with_retries, [samples[i] for i in chunk]) for chunk in chunks]
            for chunk, future in zip(chunks, futures):
                try:
                    chunk_scores, chunk_retries = future.result()
                except RemoteRewardError as exc:
                    for i in chunk:
                        errors[i] = str(exc)
                    retries += exc.attempts - 1
                    continue
                retries += chunk_retries
                for i, score in zip(chunk, chunk_scores):
                    scores[i] = score
        return RemoteScores(scores=scores, errors=errors, requests=len(chunks), retries=retries)

    def _post_with_retries(self, samples: list) -> tuple[list[float], int]:
        body = json.dumps({"samples": samples}).encode()
        attempt = 0
        while True:
            try:
                return self._post(body, len(samples)), attempt
            except _Retryable as exc:
                if attempt >= self.max_retries:
                    raise RemoteRewardError(f"reward service {self.url}: {exc} (after {attempt + 1} attempts)",
                                            attempts=attempt + 1) from exc
                time.sleep(self.backoff_s * 2**attempt)
                attempt += 1

    def _post(self, body: bytes, expected: int) -> list[float]:
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode(errors="replace")
            if exc.code == 429 or exc.code >= 500:
                raise _Retryable(f"HTTP {exc.code}: {detail}") from exc
            raise RemoteRewardError(f"reward service {self.url}: HTTP {exc.code} (not retried): {detail}",
                                    attempts=1) from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _Retryable(f"{type(reason).__name__}: {reason} (timeout {self.timeout_s:g} s)") from exc
        try:
            scores = json.loads(raw)["scores"]
        except (ValueError, KeyError, TypeError) as exc:
            raise _Retryable(f"answer is not JSON with a 'scores' list: {raw[:200]!r}") from exc
        if not isinstance(scores, list) or len(scores) != expected:
            got = len(scores) if isinstance(scores, list) else type(scores).__name__
            raise _Retryable(f"answer has {got} scores for {expected} samples")
        out = []
        for index, score in enumerate(scores):
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
                raise _Retryable(f"score {index} of the answer is not a finite number: {score!r}")
            out.append(float(score))
        return out
