"""The main job end to end at tiny size: real Ray, real megatron engines, HF rollout engine, on CPU."""

import json
import math
import statistics
from pathlib import Path

import pytest
import torch

from megarl.run_config import load_config
from megarl.trainer.metrics import read_jsonl_metrics
from tests.e2e.trainer.learning import rose_beyond_noise, sampling_sd
from tests.paths import REPO


def _config(tmp_path: Path, *overrides: str, recipe: str = "grpo_tiny.yaml"):
    return load_config(REPO / "configs" / recipe, [
        f"trainer.default_local_dir={tmp_path}", "trainer.progress_bar=false", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", *overrides,
    ])


def _run(cfg):
    from megarl.trainer.main import run

    return run(cfg)


def _tensorboard_scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    return [(s.step, s.value) for s in events.Scalars(tag)]


GOLDEN = Path(__file__).parent / "golden" / "grpo_tiny_reward.json"
WINDOW = 5  # steps per window of the reward curve
RESPONSES_PER_STEP = 16 * 8  # data.train_batch_size x rollout.n
SIGMAS = 4.0


def golden_curves() -> list[list[float]]:
    return list(json.loads(GOLDEN.read_text())["scores_by_seed"].values())


def golden_band(curves: list[list[float]] | None = None) -> list[tuple[float, float]]:
    """(low, high) of the mean reward per window of steps, from the recorded curves of seven seed sets.

    A run on another CPU samples other tokens as soon as one float differs (AVX-512 vs AVX2 kernels), so it is
    one more draw of the same learning process, not a copy of a recorded one: each window's band is the seeds'
    mean +- 4 standard deviations of the seeds' window means (at least of the sampling noise of a window mean).
    Its half-widths are the effect it can detect: a window mean off by more than that fails (see
    ``test_the_band_detects_shifts_beyond_its_half_width_and_states_them``)."""
    curves = curves or golden_curves()
    band = []
    for start in range(0, len(curves[0]), WINDOW):
        means = [statistics.fmean(curve[start:start + WINDOW]) for curve in curves]
        mean = statistics.fmean(means)
        spread = max(statistics.stdev(means), sampling_sd(mean, WINDOW, RESPONSES_PER_STEP))
        band.append((mean - SIGMAS * spread, mean + SIGMAS * spread))
    return band


def learned(scores: list[float]) -> tuple[bool, str]:
    """Whether the last 10 steps' mean reward exceeds the first 5 steps' by more than 4 standard deviations of
    that difference for a policy that does not learn (tests/e2e/trainer/learning.py)."""
    return rose_beyond_noise(scores, first=5, last=10, responses_per_step=RESPONSES_PER_STEP, sigmas=SIGMAS)


def _in_band(curve: list[float], band) -> bool:
    return all(low <= statistics.fmean(curve[i * WINDOW:(i + 1) * WINDOW]) <= high
               for i, (low, high) in enumerate(band))


def test_every_recorded_seed_lies_in_the_band_of_the_others_and_a_flat_curve_does_not():
    """Leave one out: each recorded seed against the band the other six make (a seed inside the band of all
    seven proves nothing: any one of seven values lies within 2.27 sd of their mean, and the band is 4 sd)."""
    curves = golden_curves()
    for seed, curve in enumerate(curves):
        assert learned(curve)[0], (seed, learned(curve)[1])
        assert _in_band(curve, golden_band(curves[:seed] + curves[seed + 1:])), seed
    flat = [statistics.fmean(curves[0][:5])] * 30  # a policy that never learns
    assert not learned(flat)[0] and not _in_band(flat, golden_band())


def test_the_band_detects_shifts_beyond_its_half_width_and_states_them():
    """The detectable effect per window (reward units), printed; a recorded seed moved by just more than one
    window's half-width in that window alone leaves the band, by just less it stays (the band is what it says)."""
    band, curve = golden_band(), golden_curves()[0]
    half_widths = [(high - low) / 2 for low, high in band]
    print("golden band: detectable shift of a 5-step mean reward, per window:",
          [f"steps {i * WINDOW + 1}-{(i + 1) * WINDOW}: {w:.3f}" for i, w in enumerate(half_widths)])
    for index, (low, high) in enumerate(band):
        mean = statistics.fmean(curve[index * WINDOW:(index + 1) * WINDOW])
        for target, inside in ((high + 1e-3, False), (low - 1e-3, False), ((low + high) / 2, True)):
            moved = list(curve)
            for step in range(index * WINDOW, (index + 1) * WINDOW):
                moved[step] += target - mean
            assert _in_band(moved, band) is inside, (index, target)
    assert max(half_widths[:2]) < 0.06  # the first ten steps pin the start of learning to +-0.06


def test_the_noise_model_holds_on_the_recorded_curves():
    """learning.py bounds a step's sampling noise by the binomial p(1-p)/R; the recorded curves' step-to-step
    scatter (each step against the mean of its neighbours, which removes the slow learning trend) must not
    exceed it, or every learning check would claim more certainty than it has."""
    residuals = [c[i] - (c[i - 1] + c[i + 1]) / 2 for c in golden_curves() for i in range(1, len(c) - 1)]
    scatter = math.sqrt(statistics.fmean(r * r for r in residuals) / 1.5)  # var(x - (y + z)/2) = 1.5 var
    p = statistics.fmean(statistics.fmean(c) for c in golden_curves())
    assert scatter <= sampling_sd(p, 1, RESPONSES_PER_STEP), (scatter, sampling_sd(p, 1, RESPONSES_PER_STEP))


@pytest.fixture(scope="module")
def tiny_grpo_run(tmp_path_factory):
    """The main job: 30 steps of tiny GRPO, validation at step 15. Its curve is checked against the golden band,
    and it is the uninterrupted run the resume test compares against (the learning rate is constant, so its first
    steps are those of any shorter run of the same config). That straight leg is this session's run, not the
    stored curve: a resumed run must equal it to 1e-5, which only the same machine's kernels give."""
    out = tmp_path_factory.mktemp("tiny_grpo")
    return _run(_config(out, "trainer.total_training_steps=30", "trainer.test_freq=15")), out


@pytest.mark.timeout(600)
def test_grpo_reward_follows_the_golden_curve_and_logs_everywhere(tiny_grpo_run):
    history, out = tiny_grpo_run
    scores = [h["critic/score/mean"] for h in history]
    assert len(scores) == 30
    rose, how = learned(scores)
    assert rose, f"the reward did not rise: {how}; curve {scores}"
    for index, (low, high) in enumerate(golden_band()):
        mean = statistics.fmean(scores[index * WINDOW:(index + 1) * WINDOW])
        assert low <= mean <= high, (f"steps {index * WINDOW + 1}-{(index + 1) * WINDOW}: mean reward {mean:.3f} "
                                     f"outside the golden band [{low:.3f}, {high:.3f}]; curve {scores}")
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "timing_s/gen", "timing_s/update_actor",
                "timing_s/weight_sync", "weight_sync/bytes", "perf/tokens_per_s", "response_length/mean"):
        assert key in history[-1], key
    assert history[14]["val/score/mean"] >= 0
    rows = read_jsonl_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 31))
    tb = _tensorboard_scalars(out, "critic/score/mean")
    assert [step for step, _ in tb] == list(range(1, 31))
    assert tb[-1][1] == pytest.approx(scores[-1], rel=1e-6)
    assert (out / "config.yaml").is_file()


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [
    (),
    # Two data-parallel ranks with megatron's distributed optimizer (sharded Adam state in the checkpoint).
    ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.use_distributed_optimizer=true",
     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"),
], ids=["dp1", "dp2_distributed_optimizer"])
def test_resume_reproduces_the_uninterrupted_run(tmp_path, layout, request):
    if layout:
        straight = _run(_config(tmp_path / "straight", "trainer.total_training_steps=4", *layout))
    else:  # the main job's run is the uninterrupted one
        straight = request.getfixturevalue("tiny_grpo_run")[0][:4]
    interrupted = tmp_path / "interrupted"
    _run(_config(interrupted, "trainer.total_training_steps=2", "trainer.save_freq=2", *layout))
    assert (interrupted / "checkpoints" / "global_step_2" / "trainer_state.json").is_file()
    resumed = _run(_config(interrupted, "trainer.total_training_steps=4", "trainer.save_freq=2", *layout))
    assert [h["step"] for h in resumed] == [3, 4]
    for expected, got in zip(straight[2:], resumed):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/entropy", "response_length/mean"):
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (got["step"], key)


@pytest.mark.timeout(600)
def test_ppo_with_critic_runs(tmp_path):
    """PPO through Ray workers; step 2 profiled (global_profiler): a torch trace per worker process, each worker
    method a named range."""
    history = _run(_config(tmp_path, "trainer.total_training_steps=3", "global_profiler.tool=torch",
                           "global_profiler.steps=[2]", recipe="ppo_tiny.yaml"))
    assert len(history) == 3
    for key in ("critic/vf_loss", "critic/values/mean", "actor/pg_loss"):
        assert key in history[-1], (key, sorted(history[-1]))
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step_2"]
    assert_profiled_stages(tmp_path / "profile" / "step_2", {
        "ActorRolloutRefWorker": ("generate", "compute_log_probs", "update_actor", "sync_weights"),
        "CriticWorker": ("compute_values", "update_critic")})


def assert_profiled_stages(step_dir: Path, stages: dict[str, tuple[str, ...]]) -> None:
    """Each worker class wrote a Chrome trace holding a ``megarl/<method>`` range for each of its stages."""
    import json

    for worker, methods in stages.items():
        traces = sorted(step_dir.glob(f"{worker}_rank0_*.pt.trace.json"))
        assert len(traces) == 1, sorted(p.name for p in step_dir.iterdir())
        names = {event.get("name") for event in json.loads(traces[0].read_text())["traceEvents"]}
        assert {f"megarl/{m}" for m in methods} <= names, (worker, sorted(n for n in names if "megarl" in str(n)))


def test_an_in_process_run_is_profiled_and_leaves_its_rollouts_and_validation_samples(tmp_path):
    """Step 2 profiled with its stages named; every training step's rows and every validation's in JSONL files
    (verl's rollout_data_dir / validation_data_dir), and three validation samples as a table to TensorBoard and
    val_generations.jsonl, the same prompts at each validation."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _run(_config(tmp_path, "trainer.total_training_steps=2", "trainer.backend=inprocess",
                 "global_profiler.tool=torch", "global_profiler.steps=[2]", "trainer.test_freq=1",
                 "data.val_batch_size=16", f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
                 f"trainer.validation_data_dir={tmp_path / 'validation'}", "trainer.log_val_generations=3"))
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == ["step_2"]
    assert_profiled_stages(tmp_path / "profile" / "step_2", {
        "ActorRolloutRefWorker": ("generate", "compute_log_probs", "update_actor", "sync_weights")})
    for step in (1, 2):
        rows = [json.loads(line) for line in (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        assert len(rows) == 16 * 8 and {row["step"] for row in rows} == {step}
        assert {"input", "output", "score", "data_source", "gts"} <= set(rows[0]) and rows[0]["input"]
        validation = [json.loads(line) for line in (tmp_path / "validation" / f"{step}.jsonl").read_text().splitlines()]
        assert len(validation) >= 64 and {row["step"] for row in validation} == {step}
    tables = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert [t["step"] for t in tables] == [1, 2] and all(len(t["rows"]) == 3 for t in tables)
    assert [r["input"] for r in tables[0]["rows"]] == [r["input"] for r in tables[1]["rows"]]
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("val_generations/text_summary")
    first = texts[0].tensor_proto.string_val[0].decode()
    assert [t.step for t in texts] == [1, 2] and first.splitlines()[0] == "| input | output | score |"
    assert len(first.splitlines()) == 2 + 3 and tables[0]["rows"][0]["input"].replace("\n", " ") in first


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overrides", [
    ("algorithm.adv_estimator=remax",),  # extra greedy rollout per prompt for the baseline
    ("algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.policy_loss=dual_clip"),
    ("algorithm.adv_estimator=reinforce_plus_plus", "algorithm.use_kl_in_reward=true",
     "algorithm.kl_ctrl.type=adaptive"),  # reference model + KL in the reward
    ("algorithm.adv_estimator=dr_grpo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
     "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.entropy_coeff=0.01"),
    ("actor_rollout_ref.actor.policy_loss=gspo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
     "actor_rollout_ref.actor.clip_ratio_low=0.0003", "actor_rollout_ref.actor.clip_ratio_high=0.0004"),
], ids=["remax", "rloo_dual_clip", "reinforce_pp_kl_in_reward", "dr_grpo_kl_loss", "gspo"])
def test_algorithm_variants_train_in_process(tmp_path, overrides):
    """Each estimator/loss combination through the whole loop (one rank in the driver, no Ray)."""
    history = _run(_config(tmp_path, "trainer.total_training_steps=2", "trainer.backend=inprocess", *overrides))
    assert [h["step"] for h in history] == [1, 2]
    last = history[-1]
    assert all(v == v for v in last.values()), "NaN metric"  # NaN != NaN
    if "algorithm.use_kl_in_reward=true" in overrides:
        assert "actor/reward_kl_penalty" in last and "actor/ref_kl" in last
    if "actor_rollout_ref.actor.use_kl_loss=true" in overrides:
        assert "actor/kl_loss" in last


@pytest.mark.timeout(300)
def test_dapo_dynamic_sampling_and_overlong_shaping_train(tmp_path):
    """DAPO: clip-higher, token-mean loss, groups without a score spread dropped and more prompts generated
    until train_batch_size groups remain, soft overlong penalty in the last 2 of 4 response tokens."""
    dapo = ("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0",
            "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=2",
            "reward_model.overlong_buffer.penalty_factor=0.1", "actor_rollout_ref.actor.clip_ratio_high=0.28",
            "actor_rollout_ref.actor.loss_agg_mode=token-mean")
    history = _run(_config(tmp_path, "trainer.total_training_steps=2", "trainer.backend=inprocess", *dapo))
    assert [h["step"] for h in history] == [1, 2]
    for step in history:
        assert step["filter_groups/gen_batches"] >= 1
        assert 0 < step["filter_groups/kept_group_fraction"] <= 1
        assert -0.1 <= step["reward/overlong_penalty/mean"] <= 0
        assert all(v == v for v in step.values()), "NaN metric"


def test_dynamic_sampling_names_the_knob_when_rounds_run_out(tmp_path):
    # A policy that always answers the same way scores every response of a group alike: nothing is kept.
    with pytest.raises(Exception, match=r"algorithm.filter_groups.max_num_gen_batches\) gave 0 of the 16 groups"):
        _run(_config(tmp_path, "trainer.total_training_steps=1", "trainer.backend=inprocess",
                     "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
                     "actor_rollout_ref.rollout.temperature=0.0"))


@pytest.mark.timeout(600)
def test_separate_placement_streams_weights_to_rollout_workers(tmp_path, transport="broadcast"):
    """Training on one process, rollout on two others: weights travel bucket by bucket, broadcast over a
    gloo group of their own (the object-store transport runs in tests/distributed/bench/test_transport_bench.py). The
    rollout workers' log-probs of what they sampled equal the trainer's (fp32), so every step's weights
    arrived whole."""
    history = _run(_config(tmp_path, "trainer.total_training_steps=2", "trainer.placement=separate",
                           "trainer.n_gpus_per_node=3", "trainer.rollout_gpus=2",
                           "actor_rollout_ref.rollout.weight_sync_bucket_mb=1",
                           f"actor_rollout_ref.rollout.weight_sync_transport={transport}"))
    assert [h["step"] for h in history] == [1, 2]
    assert history[-1]["weight_sync/bytes"] > 1e6 and history[-1]["weight_sync/buckets"] > 1
    for step in history:
        assert step["rollout/log_prob_diff_max"] < 1e-4, (step["step"], step["rollout/log_prob_diff_max"])


@pytest.mark.timeout(400)
def test_offloading_between_phases_changes_nothing(tmp_path):
    """Hybrid engine: params, grads and Adam state leave the device while the rollout engine generates and
    come back for training; the run must be bit-identical to one that keeps everything resident."""
    common = ("trainer.total_training_steps=2", "trainer.backend=inprocess", "actor_rollout_ref.actor.use_kl_loss=true")
    offload = ("actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
               "actor_rollout_ref.actor.megatron.optimizer_offload=true", "actor_rollout_ref.ref.param_offload=true")
    resident = _run(_config(tmp_path / "resident", *common))
    offloaded = _run(_config(tmp_path / "offloaded", *common, *offload))
    for a, b in zip(resident, offloaded):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ref_kl"):
            assert a[key] == b[key], (a["step"], key)


@pytest.mark.timeout(400)
def test_sequence_packing_with_token_budgets_trains_like_padded_rows(tmp_path):
    """Actor and reference on packed thd micro-batches grouped by token budgets: the same run as padded
    fixed-size micro-batches (fp32; only summation order differs). The critic's packing is covered by
    tests/distributed/engines/megatron/test_packing.py (PPO with a critic needs the slower Ray backend)."""
    common = ("trainer.total_training_steps=2", "trainer.backend=inprocess", "actor_rollout_ref.actor.use_kl_loss=true")
    packed = ("actor_rollout_ref.model.use_sequence_packing=true",
              "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
              "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=128",
              "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=96")
    padded_run = _run(_config(tmp_path / "padded", *common))
    packed_run = _run(_config(tmp_path / "packed", *common, *packed))
    for a, b in zip(padded_run, packed_run):
        assert b["response_length/mean"] == a["response_length/mean"]
        for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/ref_kl",
                    "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)


def _assert_trained_hf_export(export_dir: Path) -> None:
    """``export_dir`` loads with transformers (model and tokenizer) and holds weights the run changed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.models.embedded import resolve_model_path

    exported = AutoModelForCausalLM.from_pretrained(export_dir)
    initial = AutoModelForCausalLM.from_pretrained(resolve_model_path("embedded:tiny-qwen2"))
    assert AutoTokenizer.from_pretrained(export_dir)("12+3=").input_ids
    changed = [name for name, value in exported.state_dict().items()
               if not torch.equal(value, initial.state_dict()[name])]
    assert len(changed) > len(exported.state_dict()) // 2, changed


@pytest.mark.timeout(600)
def test_context_parallel_ppo_trains_and_scores_like_the_rollout(tmp_path):
    """Actor, reference and critic with each sequence split over two CP ranks (packed, token budgets,
    checkpoint saved with an HF export, and resumed): the trainer's recomputed log-probs of the sampled tokens must equal the HF rollout
    engine's (both fp32, and the CP split must not change them), and the critic must train, alone in step 1
    (verl's trainer.critic_warmup=2: the actor updates from step 2 on)."""
    cp = ("trainer.n_gpus_per_node=2", "trainer.save_freq=2", "trainer.save_hf=true", "actor_rollout_ref.actor.use_kl_loss=true",
          "trainer.critic_warmup=2",
          "actor_rollout_ref.actor.megatron.context_parallel_size=2", "critic.megatron.context_parallel_size=2",
          "actor_rollout_ref.model.use_sequence_packing=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64",
          "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=128", "critic.ppo_max_token_len_per_gpu=128")
    history = _run(_config(tmp_path, "trainer.total_training_steps=2", *cp, recipe="ppo_tiny.yaml"))
    assert [h["step"] for h in history] == [1, 2]
    for step in history:
        assert step["rollout/log_prob_diff_max"] < 1e-4, step["rollout/log_prob_diff_max"]
        assert all(v == v for v in step.values()), "NaN metric"
    assert "critic/vf_loss" in history[-1] and "actor/kl_loss" in history[-1]
    assert "critic/vf_loss" in history[0] and "timing_s/update_actor" not in history[0], history[0]
    assert not any(k in history[0] for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm")), history[0]
    assert (tmp_path / "checkpoints" / "global_step_2" / "trainer_state.json").is_file()
    _assert_trained_hf_export(tmp_path / "checkpoints" / "global_step_2" / "actor_hf")
    resumed = _run(_config(tmp_path, "trainer.total_training_steps=3", *cp, recipe="ppo_tiny.yaml"))
    assert [h["step"] for h in resumed] == [3]  # the CP checkpoint loads back into the CP layout
    assert resumed[0]["rollout/log_prob_diff_max"] < 1e-4 and "actor/pg_loss" in resumed[0]
    print({k: [h[k] for h in history + resumed] for k in ("rollout/log_prob_diff_max", "critic/vf_loss")})


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_rollout_with_tensor_parallel_replicas_follows_the_trainer(tmp_path):
    """Real vLLM (CPU build) inside the actor workers, one rollout replica sharded over both ranks
    (external launcher), megatron TP=2 on the same ranks: after every weight sync the rollout engine's
    log-probs of what it sampled equal the trainer's recomputation."""
    pytest.importorskip("vllm")
    history = _run(_config(
        tmp_path, "trainer.total_training_steps=3", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.kv_cache_memory_mb=64", "actor_rollout_ref.rollout.free_cache_engine=false"))
    assert [h["step"] for h in history] == [1, 2, 3]
    print("rollout vs trainer log-prob diff (max):", [h["rollout/log_prob_diff_max"] for h in history])
    assert history[-1]["actor/ppo_kl"] != 0  # the policy moved, so the later syncs carried new weights
    for h in history:
        # fp32 on both sides; a stale or mis-sharded weight would show up as O(0.1-1) differences
        assert h["rollout/log_prob_diff_max"] < 1e-3, (h["step"], h["rollout/log_prob_diff_max"])
    assert history[-1]["actor/grad_norm"] > 0 and history[-1]["weight_sync/bytes"] > 1e6


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllm_engines_in_process_take_device_tensors_on_two_ranks(tmp_path):
    """Two ranks, one vLLM engine each, built as the workers build them (engine core inside the worker,
    external launcher over the workers' world): each weight bucket reaches the engine as the gathered
    tensors themselves, and every step the rollout log-probs equal the trainer's recomputation."""
    pytest.importorskip("vllm")
    history = _run(_config(
        tmp_path, "trainer.total_training_steps=2", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.kv_cache_memory_mb=64", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16"))
    assert [h["step"] for h in history] == [1, 2]
    assert history[-1]["actor/ppo_kl"] != 0
    for h in history:
        assert h["rollout/log_prob_diff_max"] < 1e-3, (h["step"], h["rollout/log_prob_diff_max"])
        assert h["perf/throughput"] == pytest.approx(h["perf/tokens_per_s"] / 2)


def test_in_process_backend_cleans_up_after_a_failed_start(tmp_path):
    import torch.distributed as dist

    bad = _config(tmp_path / "bad", "trainer.backend=inprocess")
    bad.actor_rollout_ref.rollout.tensor_model_parallel_size = 2  # past validation: the worker refuses it
    with pytest.raises(NotImplementedError, match="rollout.tensor_model_parallel_size=2"):
        _run(bad)
    assert not dist.is_initialized()
    # The process can host the next run.
    assert len(_run(_config(tmp_path / "good", "trainer.backend=inprocess", "trainer.total_training_steps=1"))) == 1


def test_device_follows_the_cluster_not_the_driver():
    from megarl.controller.roles import resolve_device

    # A GPU cluster attached from a driver without CUDA (a login/head node) still trains on cuda.
    assert resolve_device(load_config(overrides=["trainer.device=cuda"]), cluster_gpus=16.0) == "cuda"
    assert resolve_device(load_config(overrides=["trainer.device=auto"]), cluster_gpus=8.0) == "cuda"
    assert resolve_device(load_config(overrides=["trainer.device=auto"]), cluster_gpus=0.0) == "cpu"
    with pytest.raises(RuntimeError, match="the Ray cluster has no GPU"):
        resolve_device(load_config(overrides=["trainer.device=cuda"]), cluster_gpus=0.0)


def _hand_computed_lr(step: int, *, peak: float, floor: float, warmup: int, decay_steps: int, style: str) -> float:
    """The lr of training step ``step`` (1-based): the schedule has advanced ``step - 1`` times, once per step."""
    import math

    k = step - 1
    if warmup and k <= warmup:
        return peak * k / warmup  # linear warmup from 0
    ratio = (k - warmup) / (decay_steps - warmup)
    coeff = 0.5 * (math.cos(math.pi * ratio) + 1) if style == "cosine" else 1 - ratio
    return floor + coeff * (peak - floor)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("style,warmup,decay", [("cosine", 1, None), ("linear", 0, 4)])
def test_lr_schedule_counts_training_steps(tmp_path, style, warmup, decay):
    """grpo_tiny takes 4 mini-batches (optimizer steps) per training step; the schedule still counts training
    steps, as verl does: a cosine over the run's 6 steps (default decay steps) ends with the run instead of at
    step 2, and an explicit decay of 4 steps reaches the floor at step 5. actor/lr is logged every step."""
    peak, floor = 2e-3, 1e-4
    steps = 6
    overrides = [f"trainer.total_training_steps={steps}", "trainer.backend=inprocess",
                 f"actor_rollout_ref.actor.optim.lr_decay_style={style}",
                 f"actor_rollout_ref.actor.optim.lr_warmup_steps={warmup}",
                 f"actor_rollout_ref.actor.optim.min_lr={floor}", f"actor_rollout_ref.actor.optim.lr={peak}"]
    if decay:
        overrides.append(f"actor_rollout_ref.actor.optim.lr_decay_steps={decay}")
    history = _run(_config(tmp_path, *overrides))
    expected = [_hand_computed_lr(s, peak=peak, floor=floor, warmup=warmup, decay_steps=decay or steps, style=style)
                if s - 1 <= (decay or steps) else floor for s in range(1, steps + 1)]
    assert [h["actor/lr"] for h in history] == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert min(expected[1:]) >= floor and expected[-1] > floor if decay is None else expected[-1] == floor


class _KilledAfterCommit(BaseException):
    """Stands for a SIGKILL right after a checkpoint commit (BaseException: nothing in the trainer catches it)."""


@pytest.mark.timeout(600)
def test_a_kill_after_a_checkpoint_commit_loses_no_metrics_line(tmp_path, monkeypatch):
    """Killed just after step 2's checkpoint committed: the resumed run starts at step 3, and metrics.jsonl
    still holds every step exactly once (the step's line is written before its checkpoint commits)."""
    from megarl.trainer.checkpoint import CheckpointManager

    commit = CheckpointManager.commit

    def commit_then_die(self, step, staging, state, **kwargs):
        result = commit(self, step, staging, state, **kwargs)
        if step == 2:
            raise _KilledAfterCommit()
        return result

    overrides = ("trainer.backend=inprocess", "trainer.save_freq=1", "trainer.logger=['jsonl']")
    monkeypatch.setattr(CheckpointManager, "commit", commit_then_die)
    with pytest.raises(_KilledAfterCommit):
        _run(_config(tmp_path, "trainer.total_training_steps=4", *overrides))
    monkeypatch.setattr(CheckpointManager, "commit", commit)
    resumed = _run(_config(tmp_path, "trainer.total_training_steps=4", *overrides))
    assert [h["step"] for h in resumed] == [3, 4]
    rows = read_jsonl_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # and the interrupted curve is the uninterrupted one, value for value
    straight = _run(_config(tmp_path / "straight", "trainer.total_training_steps=4", *overrides))
    for key in CURVE_KEYS:
        assert [r[key] for r in rows] == [h[key] for h in straight], key


@pytest.mark.timeout(600)
def test_resume_takes_the_lr_schedule_from_the_new_config(tmp_path, capfd):
    """A cosine run of 3 steps is extended to 5 with a new peak lr: the resumed steps follow the new schedule
    (decay over 5 steps, new peak) from the checkpoint's position, and the log says what came from where."""
    common = ("trainer.backend=inprocess", "trainer.save_freq=3", "actor_rollout_ref.actor.optim.lr_decay_style=cosine",
              "actor_rollout_ref.actor.optim.min_lr=1e-4")
    _run(_config(tmp_path, "trainer.total_training_steps=3", "actor_rollout_ref.actor.optim.lr=2e-3", *common))
    resumed = _run(_config(tmp_path, "trainer.total_training_steps=5", "actor_rollout_ref.actor.optim.lr=1e-3", *common))
    expected = [_hand_computed_lr(s, peak=1e-3, floor=1e-4, warmup=0, decay_steps=5, style="cosine") for s in (4, 5)]
    assert [h["actor/lr"] for h in resumed] == pytest.approx(expected, rel=1e-9)
    out = capfd.readouterr().out
    assert "LR schedule from the config (changed since the checkpoint: max_lr 0.002 -> 0.001, lr_decay_steps 3 -> 5)" in out


@pytest.mark.timeout(600)
def test_a_worker_killed_inside_a_checkpoint_write_fails_fast_and_the_run_resumes(tmp_path, monkeypatch):
    """SIGKILL of the worker after step 2's shards are written, before the commit (real Ray): the driver
    names the worker and the method within seconds (megatron's writer used to leave a child holding the
    worker's sockets, and the driver hung for ~7 minutes), step 1 stays the last checkpoint, and a rerun
    resumes from it and finishes."""
    import time

    from megarl.controller.worker_group import WorkerError
    from megarl.trainer.checkpoint import CheckpointManager

    overrides = ("trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.worker_timeout_s=300")
    monkeypatch.setenv("MEGARL_KILL_AT", "save_checkpoint:2")  # the workers inherit the driver's environment
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"save_checkpoint") as info:
        _run(_config(tmp_path, *overrides))
    assert time.monotonic() - start < 120, "the death of a worker must not wait for a timeout"
    print(f"named in {time.monotonic() - start:.1f} s of run time: {str(info.value).splitlines()[0]}")
    assert CheckpointManager(tmp_path / "checkpoints").latest_step() == 1
    monkeypatch.delenv("MEGARL_KILL_AT")
    resumed = _run(_config(tmp_path, *overrides))
    assert [h["step"] for h in resumed] == [2, 3]


@pytest.mark.timeout(600)
def test_sigterm_finishes_the_step_writes_a_checkpoint_and_exits_0(tmp_path):
    """What Slurm's pre-timeout signal (--signal=B:TERM@300) or scancel does: the run ends with exit code 0 and a
    checkpoint of the step it was in (no save_freq here), which the same command then resumes from."""
    import signal
    import subprocess
    import sys
    import time

    from megarl.trainer.checkpoint import CheckpointManager

    command = [sys.executable, "-m", "megarl.trainer.main", "--config", str(REPO / "configs" / "grpo_tiny.yaml"),
               "trainer.backend=inprocess", "trainer.total_training_steps=500", "trainer.save_freq=-1",
               "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.progress_bar=false",
               "trainer.logger=['jsonl']", f"trainer.default_local_dir={tmp_path}"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(read_jsonl_metrics(metrics)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, output
    stopped_at = CheckpointManager(tmp_path / "checkpoints").latest_step()
    assert stopped_at is not None and stopped_at >= 2
    assert [r["step"] for r in read_jsonl_metrics(metrics)] == list(range(1, stopped_at + 1))
    assert f"stopped after step {stopped_at} of 500" in output and "SIGTERM received" in output
    resumed = _run(_config(tmp_path, "trainer.backend=inprocess", f"trainer.total_training_steps={stopped_at + 1}"))
    assert [h["step"] for h in resumed] == [stopped_at + 1]


CURVE_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean")


@pytest.mark.timeout(900)
def test_sigkill_of_the_driver_at_random_points_resumes_to_the_uninterrupted_curve(tmp_path):
    """The driver (one rank in process, so the whole run) is SIGKILLed at two random moments (seeded; the seed
    and moments are printed), each rerun resumes from the last complete checkpoint, and the final curve is the
    uninterrupted run's, value for value, each step logged once."""
    import random
    import signal
    import subprocess
    import sys
    import time

    steps = 6
    overrides = ["trainer.backend=inprocess", f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
                 "trainer.logger=['jsonl']"]
    straight = _run(_config(tmp_path / "straight", *overrides))
    seed = random.randrange(2**16)
    rng = random.Random(seed)
    run_dir = tmp_path / "killed"
    command = [sys.executable, "-m", "megarl.trainer.main", "--config", str(REPO / "configs" / "grpo_tiny.yaml"),
               f"trainer.default_local_dir={run_dir}", "trainer.progress_bar=false", "trainer.val_before_train=false",
               "trainer.test_freq=-1", *overrides]
    metrics = run_dir / "metrics.jsonl"
    for kill in range(2):
        wait_for_rows, extra = rng.randint(1 + 2 * kill, 2 + 2 * kill), rng.uniform(0.0, 0.4)
        print(f"seed {seed}: kill {kill} after row {wait_for_rows} + {extra:.2f} s")
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(read_jsonl_metrics(metrics)) >= wait_for_rows):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        time.sleep(extra)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert subprocess.run(command, cwd=REPO, capture_output=True).returncode == 0
    rows = read_jsonl_metrics(metrics)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), f"seed {seed}"
    for key in CURVE_KEYS:
        assert [r[key] for r in rows] == [h[key] for h in straight], f"seed {seed}: {key}"


def test_grpo_scored_by_a_remote_reward_service(tmp_path):
    """The whole loop with reward_model.remote.url: a real HTTP service on loopback scores every response
    (given its prompt); the trainer's scores are the service's."""
    from tests.reward_service import RewardService, reference_score

    with RewardService() as service:
        history = _run(_config(tmp_path, "trainer.total_training_steps=2", "trainer.backend=inprocess",
                               f"reward_model.remote.url={service.url}", "reward_model.remote.batch_size=32"))
    samples = [s for request in service.requests for s in request]
    per_step = 16 * 8  # data.train_batch_size x rollout.n of grpo_tiny
    assert len(samples) == 2 * per_step and history[0]["reward/remote/requests"] == per_step / 32
    assert all(s["prompt"] and s["data_source"] for s in samples)
    for step, row in enumerate(history):
        step_samples = samples[step * per_step:(step + 1) * per_step]
        expected = sum(reference_score(s) for s in step_samples) / per_step
        assert row["critic/score/mean"] == pytest.approx(expected, abs=1e-6)


def test_rollout_correction_in_the_loop(tmp_path):
    """algorithm.rollout_correction through the whole loop. The HF rollout engine and the Megatron actor agree to
    ~1e-6 in fp32, so token IS weights are ~1 and the update is the uncorrected one; bounds that no ratio
    meets reject every token, and the update then changes nothing."""
    base = ["trainer.total_training_steps=2", "trainer.backend=inprocess"]
    plain = _run(_config(tmp_path / "plain", *base))
    weighted = _run(_config(tmp_path / "weighted", *base, "algorithm.rollout_correction.rollout_is=token",
                            "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                            "algorithm.rollout_correction.rollout_rs_threshold=0.01"))
    for p, w in zip(plain, weighted):
        assert w["actor/pg_loss"] == pytest.approx(p["actor/pg_loss"], rel=1e-3, abs=1e-6)
        assert w["rollout_corr/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)
        assert w["rollout_corr/rs_masked_fraction"] == 0.0
    rejected = _run(_config(tmp_path / "rejected", *base, "algorithm.rollout_correction.rollout_rs=token_k1",
                            "algorithm.rollout_correction.rollout_rs_threshold=1.5_2.0"))
    for row in rejected:
        assert row["rollout_corr/rs_masked_fraction"] == 1.0
        assert row["actor/pg_loss"] == 0.0 and row["actor/grad_norm"] == 0.0


@pytest.mark.timeout(300)
def test_random_init_runs_without_weights_on_disk(tmp_path):
    """``actor.load_weight=false`` + ``rollout.load_format=dummy``: the model directory holds config.json and the
    tokenizer only; Megatron initialises the actor, the reference starts as that same initialisation, and the
    rollout engine's random weights are replaced by the first weight sync (the rollout's log-probs equal the
    trainer's, which they cannot by chance)."""
    import shutil

    from megarl.models.embedded import resolve_model_path

    source, model = resolve_model_path("embedded:tiny-qwen2"), tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(source / name, model / name)
    history = _run(_config(tmp_path / "run", f"actor_rollout_ref.model.path={model}", "trainer.total_training_steps=2",
                           "trainer.backend=inprocess", "actor_rollout_ref.actor.use_kl_loss=true",
                           "actor_rollout_ref.actor.load_weight=false", "actor_rollout_ref.rollout.load_format=dummy"))
    assert len(history) == 2
    for step in history:
        assert step["rollout/log_prob_diff_max"] < 1e-4, (step["step"], step["rollout/log_prob_diff_max"])
    assert history[0]["actor/ref_kl"] == 0.0  # before the first update the policy is its reference
    assert history[1]["actor/ref_kl"] != 0.0


@pytest.mark.timeout(400)
def test_resume_refuses_another_run_and_a_finished_one(tmp_path, capsys):
    """The outside probe's case: rerunning after a run made with another estimator resumed it silently, trained
    nothing (its total was already reached), exited 0 and overwrote config.yaml."""
    from megarl.config import ConfigError

    common = ("trainer.backend=inprocess", "trainer.save_freq=2")
    _run(_config(tmp_path, "trainer.total_training_steps=2", *common))
    with pytest.raises(ConfigError, match=r"step 2 of a run that is done: this run's total is 2 step"):
        _run(_config(tmp_path, "trainer.total_training_steps=2", *common))
    changed = ("algorithm.adv_estimator=rloo", "actor_rollout_ref.actor.clip_ratio_high=0.28")
    with pytest.raises(ConfigError) as caught:
        _run(_config(tmp_path, "trainer.total_training_steps=3", *changed, *common))
    assert "algorithm.adv_estimator: 'grpo' -> 'rloo'" in str(caught.value)
    assert "actor_rollout_ref.actor.clip_ratio_high: 0.2 -> 0.28" in str(caught.value)
    assert "trainer.resume_allow_changes=true" in str(caught.value)
    capsys.readouterr()
    history = _run(_config(tmp_path, "trainer.total_training_steps=3", "trainer.resume_allow_changes=true", *changed,
                           *common))
    assert [h["step"] for h in history] == [3]
    out = capsys.readouterr().out
    assert "resume with a changed setting (trainer.resume_allow_changes=true): algorithm.adv_estimator" in out
    assert f"3 steps, resumes {tmp_path / 'checkpoints' / 'global_step_2'}" in out  # the start-up summary
    assert f"checkpoints: {tmp_path / 'checkpoints'} (every 2 steps and at the end)" in out
    # the refused attempts wrote nothing; the first run's config is kept beside the one that resumed it
    assert sorted(p.name for p in (tmp_path / "config_history").iterdir()) == ["config.1.yaml"]
