"""Every loss option and every batch field of the actor's and the critic's update reaches the loss, at the engine.

One CPU rank, the tiny GPT, lr = 0 (the weights never move, so every call sees the same model and its metrics
differ only through what it was given). Against one baseline call:

* each keyword option of ``ActorEngine.update_policy`` / ``CriticEngine.update_critic`` that shapes the loss,
  changed alone, changes a metric
  that the option is about (the table must name every keyword: a new option without a row fails here);
* each field that the worker methods' declarations (``@register(reads=...)`` on ``update_actor`` /
  ``update_critic``) send to the worker, perturbed alone, changes the metrics
  (a field dropped on the way, or replaced by another, changes nothing);
* the fields the engine reads are exactly the declared ones, for the updates and for the forward-only calls
  (log-probs, reference log-probs, values; read through a batch that records its reads).

The same perturbations through the driver's facade and a real worker: tests/distributed/controller/
test_update_wiring.py.
"""

from __future__ import annotations

import dataclasses
import inspect
from functools import partial

import pytest
import torch

from megarl.algorithms.distillation import DistillationSpec
from megarl.batch import TrainBatch
from megarl.controller.dispatch import method_spec
from megarl.controller.workers import ActorRolloutRefWorker, CriticWorker
from tests.dist_harness import run_distributed
from tests.numerics import untimed

# distillation on (beside the task's loss), so that the teacher's log-probs reach the loss in the baseline too
DISTILL = DistillationSpec(loss_mode="k3", use_policy_gradient=False, distillation_loss_coef=0.5)
BASE = dict(policy_loss_name="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
            policy_loss_options=None, distillation=DISTILL, entropy_coeff=0.0,
            use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl", loss_agg_mode="token-mean",
            norm_length=None, replay_routing=True)
# option -> (changed value, extra changes it needs to matter, the metrics it must move)
OPTIONS = {
    "policy_loss_name": ("gspo", {"clip_ratio_c": None}, ("pg_loss",)),
    # the loss's own settings: KL-Cov's penalty on its highest-covariance tokens
    "distillation": (DistillationSpec(loss_mode="k1", use_policy_gradient=True, use_task_rewards=False), {},
                     ("loss", "distillation_loss")),
    "policy_loss_options": ({"kl_cov_ratio": 0.3, "ppo_kl_coef": 2.0},
                            {"policy_loss_name": "kl_cov", "clip_ratio_c": None}, ("pg_loss",)),
    "clip_ratio_low": (0.05, {}, ("pg_clipfrac",)),
    "clip_ratio_high": (0.05, {}, ("pg_clipfrac", "pg_loss")),
    "clip_ratio_c": (None, {}, ("pg_clipfrac_lower", "pg_loss")),
    "entropy_coeff": (0.1, {}, ("loss",)),
    "use_kl_loss": (False, {}, ("loss",)),
    "kl_loss_coef": (0.5, {}, ("loss",)),
    "kl_loss_type": ("k1", {}, ("kl_loss",)),
    "loss_agg_mode": ("seq-mean-token-sum", {}, ("pg_loss",)),
    "norm_length": (24, {"loss_agg_mode": "seq-mean-token-sum-norm"}, ("pg_loss",)),
    # the batch's routing is not the routers' own: routing by themselves changes the log-probs
    "replay_routing": (False, {}, ("pg_loss",)),
}
SCHEDULE = {"ppo_epochs", "mini_batch_size"}  # how often the loss runs, not what it is
CRITIC_BASE = dict(cliprange_value=0.5, loss_agg_mode="token-mean", norm_length=None, replay_routing=True)
CRITIC_OPTIONS = {
    "cliprange_value": (0.05, {}, ("vf_clipfrac", "vf_loss")),
    "loss_agg_mode": ("seq-mean-token-sum", {}, ("vf_loss",)),
    "norm_length": (24, {"loss_agg_mode": "seq-mean-token-sum-norm"}, ("vf_loss",)),
    "replay_routing": (False, {}, ("vf_loss",)),
}


# A text model given images must refuse them (the vision-language engine test, tests/distributed/models/
# test_vision_language.py, shows a VL model's images reach its log-probs): that refusal is what shows it reads them.
IMAGES_REFUSED = "the batch carries images (multi_modal_inputs) but the model is text-only"


def _perturbed(batch: TrainBatch, field: str) -> TrainBatch:
    g = torch.Generator().manual_seed(7)
    if field == "multi_modal_inputs":
        image = {"pixel_values": torch.zeros(4, 1176), "image_grid_thw": torch.tensor([[1, 2, 2]])}
        return dataclasses.replace(batch, multi_modal_inputs=[image] + [None] * (len(batch) - 1))
    value = getattr(batch, field).clone()
    real = batch.response_mask.bool()
    if field == "prompt_ids":
        value[:, -1] = (value[:, -1] + 5) % 50 + 3  # the last prompt token of every row is real
    elif field == "prompt_mask":
        value[:, 0] = 1 - value[:, 0]  # one more (or one fewer) real token at the left
    elif field == "response_ids":
        value[real] = (value[real] + 3) % 50 + 3
    elif field in ("old_log_probs", "ref_log_probs", "values", "returns", "teacher_log_probs"):
        value = value + 0.3 * torch.randn(value.shape, generator=g)
    elif field == "advantages":
        value = value.flip(0)
    elif field == "rollout_is_weights":
        value = value * torch.rand(value.shape, generator=g)
    elif field in ("loss_mask", "generated_mask"):
        # as many tokens left out, but other ones: the token counts (the loss's normaliser) stay the same, so
        # only a mask that reaches the per-token loss moves it
        excluded = (batch.response_mask.bool() & ~value.bool()).nonzero()
        included = (value.bool()).nonzero()
        assert len(excluded) and len(included) > 2 * len(excluded), "the batch leaves too few tokens out"
        value = batch.response_mask.clone()
        value[included[-len(excluded):].unbind(1)] = 0
    elif field == "routed_experts":  # every known choice moved to the next experts (any expert count >= 3)
        value = torch.where(value >= 0, (value + 1) % (int(value.max()) + 1), value)
    elif field == "response_mask":
        # without a loss / generated mask it is the one that counts
        return dataclasses.replace(batch, response_mask=value, loss_mask=None, generated_mask=None)
    else:
        raise KeyError(f"no perturbation for shipped field {field!r}: add one")
    return dataclasses.replace(batch, **{field: value})


class _RecordingBatch(TrainBatch):
    """A TrainBatch that notes which of its fields are read (not counting the copy that cuts mini-batches)."""

    read: set = set()
    paused = False

    def __getattribute__(self, name):
        if name in _FIELD_NAMES and not _RecordingBatch.paused:
            _RecordingBatch.read.add(name)
        return super().__getattribute__(name)


def _select_rows_unrecorded(select_rows):
    def select(batch, index):
        _RecordingBatch.paused = True
        try:
            return select_rows(batch, index)
        finally:
            _RecordingBatch.paused = False
    select.unrecorded = True
    return select


_FIELD_NAMES = {f.name for f in dataclasses.fields(TrainBatch)}


def _record_reads(call, batch: TrainBatch) -> list[str]:
    import megarl.engines.megatron.engine as engine_module  # the shared epoch x mini-batch loop selects the rows

    if not getattr(engine_module.select_rows, "unrecorded", False):
        engine_module.select_rows = _select_rows_unrecorded(engine_module.select_rows)
    _RecordingBatch.read = set()
    call(_RecordingBatch(**{f: getattr(batch, f) for f in _FIELD_NAMES}))
    return sorted(_RecordingBatch.read)


def _sweep(update, batch, base: dict, options: dict, method: str) -> dict:
    results = {"base": update(batch), "base_again": update(batch)}
    for option, (value, extra, _) in options.items():
        results[f"option:{option}"] = update(batch, **extra, **{option: value})
        if extra:
            results[f"option:{option}:reference"] = update(batch, **extra)
    for field in method_spec(method).reads:
        try:
            results[f"field:{field}"] = update(_perturbed(batch, field))
        except ValueError as error:
            results[f"field:{field}"] = {"refused": str(error)}
    results["read"] = _record_reads(update, batch)
    return results


def _wiring_worker(rank):
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.critic import CriticEngine
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, synthetic_batch, tiny_config

    initialize_megatron_parallel(layout=ParallelLayout(), seed=1)
    frozen = OptimizerConfig(lr=0.0, min_lr=0.0)
    # an MoE model whose routers replay the batch's routing: the routing is a shipped field like the others
    config = tiny_config(moe=True)
    actor = ActorEngine(model_provider=gpt_provider(config), config=config, optimizer_config=frozen,
                        micro_batch_size=4, routing_replay=True)
    batch = synthetic_batch(8)
    g = torch.Generator().manual_seed(3)
    own = actor.log_prob_pass(batch, record_routing=True).routed_experts
    experts = torch.rand(*own.shape[:3], 4, generator=g).argsort(dim=-1)[..., :2]
    batch.routed_experts = torch.where(own >= 0, experts, own).to(torch.int16)
    log_probs, _ = actor.compute_log_probs(batch, replay_routing=True)
    shift = 0.3 * torch.randn(log_probs.shape, generator=g)
    shift[:, 0] = -1.5  # ratio e^1.5 > clip_ratio_c on the first token: the dual clip has work to do
    batch.old_log_probs = log_probs + shift
    batch.ref_log_probs = log_probs + 0.2 * torch.randn(log_probs.shape, generator=g)
    batch.teacher_log_probs = log_probs - 0.5 * torch.rand(log_probs.shape, generator=g)
    batch.advantages = torch.randn(8, 1, generator=g).expand_as(log_probs).contiguous()
    batch.rollout_is_weights = 0.5 + torch.rand(log_probs.shape, generator=g)
    batch.loss_mask = batch.response_mask.clone()
    batch.loss_mask[::2, 1] = 0  # tool tokens, say
    results = {"actor": _sweep(lambda b, **changes: actor.update_policy(b, mini_batch_size=8, **{**BASE, **changes}),
                               batch, BASE, OPTIONS, ActorRolloutRefWorker.update_actor)}
    # the forward-only calls the worker makes with a shipped batch (the reference engine is the same class)
    results["log_probs_read"] = _record_reads(actor.compute_log_probs, batch)

    critic_config = tiny_config(moe=True)
    critic = CriticEngine(model_provider=gpt_provider(critic_config), config=critic_config, optimizer_config=frozen,
                          micro_batch_size=4, routing_replay=True)
    predicted = critic.compute_values(batch, replay_routing=True)
    batch.values = predicted + 0.6 * torch.randn(predicted.shape, generator=g)  # old values: clipping has work
    batch.returns = predicted + torch.randn(predicted.shape, generator=g)
    batch.generated_mask = batch.loss_mask.clone()
    results["critic"] = _sweep(
        lambda b, **changes: critic.update_critic(b, mini_batch_size=8, **{**CRITIC_BASE, **changes}),
        batch, CRITIC_BASE, CRITIC_OPTIONS, CriticWorker.update_critic)
    results["values_read"] = _record_reads(partial(critic.compute_values, replay_routing=True), batch)
    return results


@pytest.fixture(scope="module")
def wiring():
    return run_distributed(_wiring_worker, 1, timeout_s=300)[0]


def _moved(a: dict, b: dict, names) -> bool:
    return any(abs(a.get(n, 0.0) - b.get(n, 0.0)) > 1e-6 * max(1.0, abs(a.get(n, 0.0))) for n in names)


ROLES = {"actor": (ActorRolloutRefWorker.update_actor, "ActorEngine", "update_policy", OPTIONS, BASE,
                   ("pg_loss", "loss", "kl_loss", "grad_norm", "distillation_loss")),
         "critic": (CriticWorker.update_critic, "CriticEngine", "update_critic", CRITIC_OPTIONS, CRITIC_BASE,
                    ("vf_loss", "grad_norm"))}


@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_option_table_names_every_keyword_of_the_update(role):
    import megarl.engines.megatron.actor
    import megarl.engines.megatron.critic

    _, engine, method, options, base, _ = ROLES[role]
    cls = getattr(getattr(megarl.engines.megatron, role), engine)
    keywords = {name for name, p in inspect.signature(getattr(cls, method)).parameters.items()
                if p.kind is p.KEYWORD_ONLY}
    assert keywords - SCHEDULE == set(options) == set(base)


def test_the_baseline_repeats_exactly(wiring):
    for role in ROLES:
        # lr = 0: only the inputs move a metric (the step's wall time aside)
        assert untimed(wiring[role]["base"]) == untimed(wiring[role]["base_again"]), role
    assert wiring["actor"]["base"]["pg_clipfrac"] > 0 and wiring["actor"]["base"]["pg_clipfrac_lower"] > 0
    assert wiring["critic"]["base"]["vf_clipfrac"] > 0, wiring["critic"]["base"]


@pytest.mark.parametrize("role, option", [(r, o) for r in sorted(ROLES) for o in sorted(ROLES[r][3])])
def test_each_loss_option_reaches_the_loss_and_shows_in_its_metric(wiring, role, option):
    _, extra, metrics = ROLES[role][3][option]
    results = wiring[role]
    reference = results[f"option:{option}:reference"] if extra else results["base"]
    assert _moved(reference, results[f"option:{option}"], metrics), (option, reference, results[f"option:{option}"])


@pytest.mark.parametrize("role, field", [(r, f) for r in sorted(ROLES) for f in method_spec(ROLES[r][0]).reads])
def test_each_shipped_field_reaches_the_loss(wiring, role, field):
    result = wiring[role][f"field:{field}"]
    if field == "multi_modal_inputs":
        assert IMAGES_REFUSED in result.get("refused", ""), (role, result)
        return
    assert "refused" not in result, (role, field, result)
    assert _moved(wiring[role]["base"], result, ROLES[role][5]), (role, field)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_the_engine_reads_exactly_the_shipped_fields(wiring, role):
    assert wiring[role]["read"] == sorted(method_spec(ROLES[role][0]).reads)


@pytest.mark.parametrize("results, methods", [
    ("log_probs_read", (ActorRolloutRefWorker.compute_log_probs, ActorRolloutRefWorker.compute_ref_log_probs)),
    ("values_read", (CriticWorker.compute_values,))])
def test_the_forward_only_calls_read_exactly_the_declared_fields(wiring, results, methods):
    for method in methods:
        assert wiring[results] == sorted(method_spec(method).reads), method.__qualname__


# --- every policy loss through the engine: padded and packed micro-batches -----------------------------------
# (the losses' own references: tests/unit/algorithms/test_policy_loss_variants.py)
LOSSES = ("ppo_clip", "gspo", "cispo", "sapo", "geo_mean", "gpg", "kl_cov", "clip_cov", "sppo")
BATCH_STATISTICS = ("kl_cov", "clip_cov")  # statistics over the micro-batch: compared with one micro-batch
LOSS_OPTIONS = {"kl_cov": {"kl_cov_ratio": 0.2, "ppo_kl_coef": 1.0}, "sapo": {"tau_pos": 1.0, "tau_neg": 2.0},
                "sppo": {"sppo_eta": 2.0},
                "clip_cov": {"clip_cov_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}}
ROWS = 8


def _every_loss_worker(rank):
    from megatron.core.optimizer import OptimizerConfig

    from megarl.algorithms import get_policy_loss
    from megarl.engines.megatron.actor import ActorEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from tests.distributed.engines.megatron.tiny_setup import gpt_provider, synthetic_batch, tiny_config

    initialize_megatron_parallel(layout=ParallelLayout(), seed=1)
    frozen = OptimizerConfig(lr=0.0, min_lr=0.0)
    engines = {}
    for layout, micro_batching, mbs in (("padded", MicroBatching(), 2), ("packed", MicroBatching(True, 40), 2)):
        config = tiny_config()
        engines[layout] = ActorEngine(model_provider=gpt_provider(config, sdpa=True), config=config,
                                      optimizer_config=frozen, micro_batch_size=mbs, micro_batching=micro_batching)
    engines["packed"].model[0].load_state_dict(engines["padded"].model[0].state_dict())
    batch = synthetic_batch(ROWS, seed=11)
    g = torch.Generator().manual_seed(5)
    log_probs, _ = engines["padded"].compute_log_probs(batch)
    batch.old_log_probs = log_probs + 0.4 * torch.randn(log_probs.shape, generator=g)
    batch.advantages = 3 * torch.randn(ROWS, 1, generator=g).expand_as(log_probs).contiguous()
    mask = batch.response_mask
    results = {}
    for name in LOSSES:
        options = LOSS_OPTIONS.get(name)
        expected, expected_metrics = get_policy_loss(name)(
            log_probs=log_probs, old_log_probs=batch.old_log_probs, advantages=batch.advantages, response_mask=mask,
            clip_ratio_low=0.2, clip_ratio_high=0.2, loss_agg_mode="token-mean", norm_length=mask.shape[1],
            **(options or {}))
        for layout, engine in engines.items():
            # the statistics of kl_cov / clip_cov are the micro-batch's: one micro-batch, as the reference has
            one = name in BATCH_STATISTICS
            saved = engine.micro_batch_size, engine.micro_batching
            if one:
                engine.micro_batch_size = ROWS
                engine.micro_batching = MicroBatching(saved[1].sequence_packing,
                                                      10_000 if saved[1].sequence_packing else None)
            metrics = engine.update_policy(batch, policy_loss_name=name, clip_ratio_c=None,
                                           policy_loss_options=options, mini_batch_size=ROWS)
            engine.micro_batch_size, engine.micro_batching = saved
            results[(name, layout)] = dict(pg_loss=metrics["pg_loss"], pg_clipfrac=metrics["pg_clipfrac"],
                                           expected=float(expected), expected_clipfrac=expected_metrics["pg_clipfrac"])
    # DPO over (chosen, rejected) pairs: micro-batches of whole pairs (two rows; packed by rows, not by tokens)
    pairs = dataclasses.replace(batch, advantages=torch.tensor([1.0, -1.0] * (ROWS // 2))[:, None] * mask,
                                ref_log_probs=log_probs + 0.5 * torch.randn(log_probs.shape, generator=g))
    expected, _ = get_policy_loss("dpo")(
        log_probs=log_probs, old_log_probs=pairs.old_log_probs, advantages=pairs.advantages, response_mask=mask,
        clip_ratio_low=0.2, clip_ratio_high=0.2, ref_log_probs=pairs.ref_log_probs, dpo_beta=0.5)
    for layout, engine in engines.items():
        saved = engine.micro_batching
        engine.micro_batching = MicroBatching(saved.sequence_packing, None)
        metrics = engine.update_policy(pairs, policy_loss_name="dpo", clip_ratio_c=None,
                                       policy_loss_options={"dpo_beta": 0.5}, mini_batch_size=ROWS)
        engine.micro_batching = saved
        results[("dpo", layout)] = dict(pg_loss=metrics["pg_loss"], expected=float(expected))
    return results


@pytest.fixture(scope="module")
def every_loss():
    return run_distributed(_every_loss_worker, 1, timeout_s=300)[0]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_dpo_reaches_the_engine_over_whole_pairs_with_the_references_log_probs(every_loss, layout):
    got = every_loss[("dpo", layout)]
    assert got["pg_loss"] == pytest.approx(got["expected"], rel=1e-5, abs=1e-6), got
    assert abs(got["pg_loss"] - every_loss[("ppo_clip", layout)]["pg_loss"]) > 1e-4


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("name", LOSSES)
def test_every_policy_loss_reaches_the_engine_and_shows_in_its_metrics(every_loss, name, layout):
    got = every_loss[(name, layout)]
    # the engine's micro-batch shares against the loss on the whole batch's log-probs (fp32 model: a few ulps of
    # fp32 at the loss's scale)
    assert got["pg_loss"] == pytest.approx(got["expected"], rel=1e-5, abs=1e-6), (name, layout, got)
    if name != "ppo_clip":  # the loss acted: another value than PPO's on the same batch
        assert abs(got["pg_loss"] - every_loss[("ppo_clip", layout)]["pg_loss"]) > 1e-4, (name, layout)
    if name in ("cispo", "geo_mean", "kl_cov", "clip_cov"):  # and the tokens it treated apart are counted
        assert got["pg_clipfrac"] > 0 and got["pg_clipfrac"] == pytest.approx(got["expected_clipfrac"], rel=1e-5)
