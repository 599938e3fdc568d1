"""async_training.mode=fully_async: the rollout producer's partial-rollout semantics with a real rollout worker
(HF engine, embedded model) in this process, and the whole loop on CPU with real Ray, a training and a rollout
process."""

import io
import time
from pathlib import Path

import pytest
import torch

from megarl.run_config import load_config
from tests.e2e.trainer.learning import rose_beyond_noise
from tests.paths import REPO

FULLY_ASYNC = ["trainer.placement=separate", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1",
               "async_training.mode=fully_async"]


def _config(out: Path, *overrides: str):
    return load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"trainer.default_local_dir={out}", "trainer.progress_bar=false", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", *FULLY_ASYNC, *overrides])


@pytest.fixture
def producer_parts(tmp_path):
    from transformers import AutoTokenizer

    from megarl.controller.inprocess_group import InProcessWorkerGroup
    from megarl.controller.roles import Rollout
    from megarl.controller.rollout_worker import RolloutWorker
    from megarl.models.embedded import resolve_model_path
    from megarl.trainer.main import build_data

    cfg = _config(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_path(cfg.actor_rollout_ref.model.path)))
    loader, _ = build_data(cfg, tokenizer)
    group = InProcessWorkerGroup(RolloutWorker, device="cpu", init_kwargs=dict(cfg=cfg), name_prefix="rollout")
    yield cfg, Rollout(group, RolloutWorker.generate), loader
    group.shutdown()


def _after_first_call(producer) -> None:
    """Pause once the producer's first call has started (and so, once paused, has been absorbed)."""
    deadline = time.monotonic() + 60
    while producer.calls < 1:
        assert time.monotonic() < deadline, "the producer never started a call"
        time.sleep(0.005)
    producer.pause()


def _producer(cfg, rollout, loader, **overrides):
    from megarl.trainer.rollout_modes import build_producer

    producer = build_producer(cfg, rollout, loader)
    for name, value in overrides.items():
        setattr(producer, name, value)
    return producer


def test_a_weight_push_interrupts_generations_and_tokens_keep_their_version(producer_parts):
    cfg, rollout, loader = producer_parts
    producer = _producer(cfg, rollout, loader, chunk_tokens=1)  # one token per response per call
    producer.start()
    _after_first_call(producer)  # the first call's tokens are in: all of version 0
    assert producer.queue, "responses left to continue"
    producer.resume(version=1)  # as after a weight push
    groups, metrics = producer.take(1, max_staleness=1, drop_stale=True)
    producer.stop()
    requests = [r for g in groups for r in g.requests]
    assert len(groups) == cfg.data.train_batch_size and len(requests) == 8 * len(groups)
    for r in requests:
        assert len(r.tokens) == len(r.log_probs) == len(r.versions) <= cfg.data.max_response_length
        assert r.versions == sorted(r.versions) and r.versions[0] == 0  # started before the push
    interrupted = [r for r in requests if set(r.versions) == {0, 1}]
    assert interrupted and metrics["async/interrupted_responses"] == len(interrupted)
    # a continuation is the same request going on: its first token came from the first call only
    assert all(r.versions.count(0) >= 1 for r in interrupted)
    assert metrics["async/staleness_max"] == 1.0 and metrics["async/dropped_groups"] == 0.0


def test_the_producer_state_round_trips_and_stale_groups_are_dropped(producer_parts):
    cfg, rollout, loader = producer_parts
    producer = _producer(cfg, rollout, loader, chunk_tokens=2)
    producer.start()
    _after_first_call(producer)
    state = producer.state_dict()
    restored = _producer(cfg, rollout, loader)
    blob = io.BytesIO()
    torch.save(state, blob)
    restored.load_state_dict(torch.load(io.BytesIO(blob.getvalue()), weights_only=False))
    assert restored.next_group == producer.next_group and list(restored.buffer) == list(producer.buffer)
    assert [(r.group, r.tokens) for r in restored.queue] == [(r.group, r.tokens) for r in producer.queue]
    # the queued requests are the restored groups' own objects, so continuing them completes those groups
    assert all(any(r is q for r in restored.groups[q.group].requests) for q in restored.queue)
    producer.stop()
    restored.start()
    # policy version 5: every group (generated at version 0) lags 5 > 1 and is dropped, so take waits for ...
    restored.resume(version=5)  # ... groups generated at version 5, which then arrive
    groups, metrics = restored.take(5, max_staleness=1, drop_stale=True)
    restored.stop()
    assert metrics["async/dropped_groups"] >= 1 and all(g.oldest_version == 5 for g in groups)


@pytest.mark.timeout(600)
def test_fully_async_grpo_learns_within_the_staleness_bound_and_resumes_its_buffer(tmp_path):
    from megarl.trainer.main import run

    out = tmp_path / "run"
    first = run(_config(out, "trainer.total_training_steps=3", "trainer.save_freq=3",
                        "async_training.partial_rollout_chunk=2", "algorithm.rollout_correction.rollout_is=token"))
    assert (out / "checkpoints" / "global_step_3" / "rollout_buffer.pt").is_file()
    resumed = run(_config(out, "trainer.total_training_steps=8", "async_training.partial_rollout_chunk=2",
                          "algorithm.rollout_correction.rollout_is=token"))
    history = first + resumed
    assert [row["step"] for row in history] == list(range(1, 9))
    for row in history:
        # the taken groups are within the bound (older ones were dropped and counted)
        assert row["async/staleness_max"] <= 1.0
        assert row["rollout_corr/is_weight_mean"] > 0
    assert history[0]["async/staleness_max"] == 0.0 and history[0]["rollout/log_prob_diff_mean"] < 1e-4
    rose, how = rose_beyond_noise([row["critic/score/mean"] for row in history], first=3, last=3,
                                  responses_per_step=16 * 8)  # grpo_tiny: data.train_batch_size x rollout.n
    assert rose, how


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode, kill_at", [("one_step_off", "rollout_generate:3"), ("fully_async", "rollout_generate:3"),
                                           ("one_step_off", "rollout_receive_weights:5")])
def test_a_dead_rollout_worker_fails_the_run_fast_with_its_name(tmp_path, monkeypatch, mode, kill_at):
    """SIGKILL of the rollout worker as it starts its third generation, while the trainer trains beside it, or
    as it takes a weight bucket from training rank 0 (which then fails in sync_weights): the run fails naming
    the rollout group within seconds, not the live trainer rank that saw the death; no hang in the producer."""
    from megarl.controller.worker_group import WorkerError
    from megarl.trainer.main import run
    from megarl.trainer.rollout_producer import ProducerError

    monkeypatch.setenv("MEGARL_KILL_AT", kill_at)  # the workers inherit the driver's environment
    start = time.monotonic()
    with pytest.raises((WorkerError, ProducerError)) as info:
        run(_config(tmp_path, f"async_training.mode={mode}", "trainer.total_training_steps=6",
                    "trainer.worker_timeout_s=300", "async_training.partial_rollout_chunk=2"))
    assert time.monotonic() - start < 120, "a dead worker must not wait for a timeout"
    error = info.value if isinstance(info.value, WorkerError) else info.value.__cause__
    assert isinstance(error, WorkerError) and error.group_name == "rollout" and "died" in str(error), str(error)
    if kill_at.startswith("rollout_generate"):
        assert "generate" in str(error), str(error)
    else:
        assert "'actor_rollout_ref' rank 0 was calling it in sync_weights()" in str(error), str(error)


@pytest.mark.timeout(600)
def test_reweighting_keeps_stale_groups_for_the_importance_weights(tmp_path):
    """stale_policy=reweight with weights pushed every second step: nothing is dropped, groups two updates old
    train with the rollout correction's token importance weights."""
    from megarl.trainer.main import run

    history = run(_config(tmp_path, "trainer.total_training_steps=5", "async_training.stale_policy=reweight",
                          "async_training.max_staleness=2", "async_training.trigger_parameter_sync_step=2",
                          "algorithm.rollout_correction.rollout_is=token"))
    assert all(row["async/dropped_groups"] == 0.0 for row in history)
    assert max(row["async/staleness_max"] for row in history) >= 1.0
    assert all("weight_sync/seconds" in row for row in history if row["step"] % 2 == 0 or row["step"] == 5)
    assert all("weight_sync/seconds" not in row for row in history if row["step"] in (1, 3))
    assert all(0 < row["rollout_corr/is_weight_mean"] for row in history)
