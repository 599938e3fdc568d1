"""Config loading: defaults, YAML, overrides, and errors that name the key."""

import pytest

from megarl.config import ConfigError, MegarlConfig, save_config
from megarl.run_config import load_config
from tests.paths import REPO

# the sizes these checks were written against (the CPU demo's): the schema's own defaults are production-sized
DEMO_SIZES = ["data.max_prompt_length=32", "data.max_response_length=8", "data.train_batch_size=16",
              "actor_rollout_ref.actor.ppo_mini_batch_size=16", "critic.ppo_mini_batch_size=16"]


def test_defaults_construct_and_validate():
    cfg = load_config()
    assert isinstance(cfg, MegarlConfig)
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == cfg.actor_rollout_ref.actor.clip_ratio
    assert cfg.critic.enable is False  # grpo needs no critic
    # no name given: one derived from the estimator and the model, never the demo's folder (interpolated)
    assert cfg.trainer.default_local_dir == "outputs/megarl/grpo_tiny-qwen2"
    # production-sized defaults (verl's), not the CPU demo's: that one sets its own in configs/grpo_tiny.yaml
    d, arr = cfg.data, cfg.actor_rollout_ref
    assert (d.max_prompt_length, d.max_response_length, d.train_batch_size) == (512, 512, 1024)
    assert (arr.rollout.name, arr.rollout.dtype, arr.actor.megatron.params_dtype) == ("vllm", "bfloat16", "bfloat16")


def test_a_run_without_a_name_gets_its_own_folder_and_hears_which_usual_keys_it_left_to_defaults(tmp_path):
    from megarl.config.loader import given_keys
    from megarl.config.verl_keys import defaulted_usual_keys

    overrides = ["algorithm.adv_estimator=rloo", f"actor_rollout_ref.model.path={tmp_path}/Qwen2.5-7B-Instruct/",
                 "data.max_prompt_length=1024", "trainer.total_training_steps=5"]
    cfg = load_config(None, overrides)
    assert cfg.trainer.experiment_name == "rloo_Qwen2.5-7B-Instruct"
    assert cfg.trainer.default_local_dir == "outputs/megarl/rloo_Qwen2.5-7B-Instruct"
    defaulted = defaulted_usual_keys(cfg, given_keys(None, overrides))
    assert "data.max_response_length=512" in defaulted and "actor_rollout_ref.rollout.name=vllm" in defaulted
    assert not any(k.startswith(("data.max_prompt_length=", "algorithm.adv_estimator=", "trainer.total_epochs="))
                   for k in defaulted)
    tiny = str(REPO / "configs" / "grpo_tiny.yaml")
    named = load_config(tiny, [])
    assert named.trainer.experiment_name == "grpo_tiny"  # a name given is kept
    assert "trainer.experiment_name" in given_keys(tiny, [])


def test_checking_reads_only_and_defaults_are_filled_apart():
    import copy

    from megarl.config.defaults import fill_derived_defaults
    from megarl.config.validate import check_config

    unfilled = MegarlConfig()  # what the schema gives: the derived fields still None
    assert unfilled.critic.enable is None and unfilled.actor_rollout_ref.actor.clip_ratio_low is None
    filled = fill_derived_defaults(copy.deepcopy(unfilled))
    assert filled.critic.enable is False and filled.actor_rollout_ref.actor.clip_ratio_low == 0.2
    assert filled.critic.use_sequence_packing == filled.actor_rollout_ref.model.use_sequence_packing
    before = copy.deepcopy(filled)
    check_config(filled)
    assert filled == before


def test_overrides_are_typed(tmp_path):
    cfg = load_config(overrides=[
        "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.optim.lr=3e-6",
        "trainer.logger=[console,jsonl]", "data.train_files=/a.parquet", "critic.model_path=null",
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null",
    ])
    assert cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable is True
    assert cfg.actor_rollout_ref.rollout.n == 4
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert cfg.data.train_files == ["/a.parquet"]
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.rollout.nn=2", r"unknown config key 'actor_rollout_ref.rollout.nn' \(did you mean 'n'\?\)"),
    ("actor_rollout_ref.rollout.n=abc", r"actor_rollout_ref.rollout.n: expected an integer, got str 'abc'"),
    ("trainer.progress_bar=3", r"trainer.progress_bar: expected true/false"),
    ("data.max_prompt_length=null", r"data.max_prompt_length: null is not allowed"),
    ("algorithm.adv_estimator=ppo", r"algorithm.adv_estimator='ppo' is not one of"),
    ("algorithm.adv_estimator=gae critic.enable=false", None),
    ("trainer.logger=[console,comet]", r"trainer.logger\[1\]='comet'"),
    ("data.train_batch_size=10", r"data.train_batch_size=10 is not divisible by actor_rollout_ref.actor.ppo_mini_batch_size=16"),
    ("actor_rollout_ref.rollout.n=1", r"needs actor_rollout_ref.rollout.n >= 2"),
    ("trainer.n_gpus_per_node=3", r"not divisible|cannot be split"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", r"not divisible by actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"),
    ("trainer.experiment_name=${trainer.nope}", r"interpolation \$\{trainer.nope\} refers to an unknown key"),
    ("nokey", r"not of the form a.b.c=value"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
     r"actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096 groups rows by tokens and needs "
     r"actor_rollout_ref.model.use_sequence_packing=true"),
    ("actor_rollout_ref.model.use_sequence_packing=true actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=39",
     r"actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=39 is smaller than the longest possible row: "
     r"data.max_prompt_length \+ data.max_response_length = 40"),
    ("critic.ppo_max_token_len_per_gpu=100", r"critic.ppo_max_token_len_per_gpu=100 groups rows by tokens and needs "
                                             r"critic.use_sequence_packing=true"),
    ("trainer.n_gpus_per_node=2 actor_rollout_ref.actor.megatron.context_parallel_size=2 "
     "actor_rollout_ref.model.layer_spec=te",
     r"actor_rollout_ref.actor.megatron.context_parallel_size=2 runs on the local layer spec's SDPA attention"),
    ("trainer.n_gpus_per_node=4 actor_rollout_ref.actor.megatron.context_parallel_size=2 "
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2 actor_rollout_ref.actor.megatron.sequence_parallel=true",
     r"context_parallel_size=2 runs on the local layer spec, which has no sequence-parallel norm: set "
     r"actor_rollout_ref.actor.megatron.sequence_parallel=false"),
    ("trainer.n_gpus_per_node=2 actor_rollout_ref.actor.megatron.context_parallel_size=2 "
     "actor_rollout_ref.model.use_sequence_packing=true actor_rollout_ref.actor.ppo_max_token_len_per_gpu=19",
     r"ppo_max_token_len_per_gpu=19 is smaller than the longest possible row: .* = 40 \(context_parallel_size=2: "
     r"a row of 40 tokens over 2 GPUs\); use at least 20"),
    ("actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.quantization=fp8",
     r"actor_rollout_ref.rollout.quantization=fp8 is vLLM's: it needs actor_rollout_ref.rollout.name=vllm"),
    ("actor_rollout_ref.rollout.quantization=int4", r"actor_rollout_ref.rollout.quantization"),
    ("actor_rollout_ref.rollout.name=hf actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=fp8",
     r"engine_kwargs.vllm is set \(\['kv_cache_dtype'\]\) and the rollout engine is 'hf': set "
     r"actor_rollout_ref.rollout.name=vllm"),
    ("actor_rollout_ref.actor.megatron.router_replay.mode=R3",
     r"router_replay.mode=R3 replays the rollout's routing: set actor_rollout_ref.rollout.enable_rollout_routing_replay"),
    ("actor_rollout_ref.actor.megatron.router_replay.mode=R4", r"actor_rollout_ref.actor.megatron.router_replay.mode"),
])
def test_bad_settings_name_the_key(override, message):
    overrides = override.split(" ")
    if message is None:
        message = r"algorithm.adv_estimator=gae needs a critic, but critic.enable=false"
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=DEMO_SIZES + overrides)


def test_token_budgets_replace_the_micro_batch_divisibility_check():
    cfg = load_config(overrides=DEMO_SIZES + ["actor_rollout_ref.model.use_sequence_packing=true",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64"])
    assert cfg.critic.use_sequence_packing is True  # follows the actor's model unless set


def test_context_parallel_budget_is_per_gpu():
    cfg = load_config(overrides=DEMO_SIZES + ["trainer.n_gpus_per_node=2",
                                              "actor_rollout_ref.actor.megatron.context_parallel_size=2",
                                 "actor_rollout_ref.model.use_sequence_packing=true",
                                 "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=20"])
    assert cfg.actor_rollout_ref.actor.megatron.context_parallel_size == 2


def test_tensor_parallel_must_divide_world():
    with pytest.raises(ConfigError, match="not divisible by actor_rollout_ref.actor.megatron.tensor_model_parallel_size"):
        load_config(overrides=["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])


def test_yaml_file_errors_name_file_and_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_epoch: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'trainer.total_epoch' \(did you mean 'total_epochs'\?\)"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(tmp_path / "list.yaml")


def test_names_are_checked_against_the_registries_themselves():
    """No copy of the registries' names: what they hold is valid, what they do not is named with their list, and
    an estimator registered later is accepted at once, its needs (several responses per prompt) checked."""
    from megarl.algorithms import (ADVANTAGE_ESTIMATORS, GROUP_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES,
                                   register_advantage)

    # SPIN's pair labels and their DPO loss come together (checked by test_self_play_settings_go_together)
    partner = {"spin": "actor_rollout_ref.actor.policy_loss=dpo", "dpo": "algorithm.adv_estimator=spin"}
    for name in ADVANTAGE_ESTIMATORS.names():
        load_config(overrides=[f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=4"]
                    + ([partner[name]] if name in partner else []))
    for name in POLICY_LOSSES.names() + ["dual_clip"]:  # dual_clip: verl's older name of ppo_clip
        load_config(overrides=[f"actor_rollout_ref.actor.policy_loss={name}"]
                    + ([partner[name]] if name in partner else []))
    for name in KL_ESTIMATORS.names():
        load_config(overrides=[f"actor_rollout_ref.actor.kl_loss_type={name}", f"algorithm.kl_penalty={name}"])
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='leave_one_in' is not one of .*grpo"):
        load_config(overrides=["algorithm.adv_estimator=leave_one_in"])

    name = "test_only_group_mean_baseline"
    register_advantage(name, uses_groups=True)(lambda **kwargs: None)
    try:
        assert load_config(overrides=[f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=2"])
        with pytest.raises(ConfigError, match=f"adv_estimator={name} compares responses to the same prompt"):
            load_config(overrides=[f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=1"])
    finally:  # other tests walk the registry
        ADVANTAGE_ESTIMATORS._table.pop(name)
        GROUP_ESTIMATORS.discard(name)


def test_ppo_clip_takes_verls_dual_clip_by_default():
    """verl's default policy loss always bounds negative-advantage tokens by clip_ratio_c (3.0): a verl recipe
    ported as is must train the same way here; null turns the dual clip off."""
    from megarl.controller.engine_specs import policy_loss_arguments

    def arguments(*overrides):
        return policy_loss_arguments(load_config(overrides=list(overrides)).actor_rollout_ref.actor)

    assert arguments() == dict(policy_loss_name="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                               policy_loss_options={})
    assert arguments("actor_rollout_ref.actor.clip_ratio_c=2.5")["clip_ratio_c"] == 2.5
    assert arguments("actor_rollout_ref.actor.policy_loss=dual_clip") == arguments()
    assert arguments("actor_rollout_ref.actor.policy_loss.loss_mode=ppo_clip") == arguments()
    assert arguments("actor_rollout_ref.actor.clip_ratio_c=null")["clip_ratio_c"] is None
    assert arguments("actor_rollout_ref.actor.policy_loss=gspo")["clip_ratio_c"] is None
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.clip_ratio_c .* must be > 1, or null"):
        arguments("actor_rollout_ref.actor.clip_ratio_c=0.5")


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.adv_estimator=spin"], "SPIN is algorithm.adv_estimator=spin with"),
    (["actor_rollout_ref.actor.policy_loss=dpo"], "SPIN is algorithm.adv_estimator=spin with"),
    (["algorithm.adv_estimator=spin", "actor_rollout_ref.actor.policy_loss=dpo",
      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], "pairs must not be split"),
    (["algorithm.adv_estimator=spin", "actor_rollout_ref.actor.policy_loss=dpo",
      "actor_rollout_ref.model.use_sequence_packing=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512"],
     "splits DPO's pairs"),
    (["trainer.ref_update_freq=2", "actor_rollout_ref.model.lora.rank=8"], "the reference is the frozen base"),
])
def test_self_play_settings_go_together(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_critic_warmup_needs_a_critic_and_a_count():
    assert load_config(overrides=["algorithm.adv_estimator=gae", "trainer.critic_warmup=5"]).trainer.critic_warmup == 5
    assert load_config(overrides=["trainer.critic_warmup=1"]).trainer.critic_warmup == 1  # verl's: the actor updates at step 1
    with pytest.raises(ConfigError, match=r"trainer.critic_warmup=3 holds the actor back .* has no critic"):
        load_config(overrides=["trainer.critic_warmup=3"])
    with pytest.raises(ConfigError, match="trainer.critic_warmup must be >= 0"):
        load_config(overrides=["algorithm.adv_estimator=gae", "trainer.critic_warmup=-1"])


def test_verls_policy_loss_block_and_each_losss_own_options():
    """verl spells the loss actor.policy_loss.loss_mode (its options beside it, SAPO's temperatures on the actor);
    megarl's shorter policy_loss=<mode> is the same key, and each loss gets the options its function takes."""
    from megarl.controller.engine_specs import policy_loss_arguments

    def arguments(*overrides):
        return policy_loss_arguments(load_config(overrides=list(overrides)).actor_rollout_ref.actor)

    assert arguments("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla")["policy_loss_name"] == "ppo_clip"
    kl_cov = arguments("actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
                       "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.01")
    assert kl_cov["policy_loss_options"] == dict(kl_cov_ratio=0.01, ppo_kl_coef=0.1) and kl_cov["clip_ratio_c"] is None
    assert arguments("actor_rollout_ref.actor.policy_loss=clip_cov")["policy_loss_options"] == dict(
        clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0)
    assert arguments("actor_rollout_ref.actor.policy_loss=sapo", "actor_rollout_ref.actor.tau_neg=2.0")[
        "policy_loss_options"] == dict(tau_pos=1.0, tau_neg=2.0)
    assert arguments("actor_rollout_ref.actor.policy_loss=sppo", "actor_rollout_ref.actor.sppo_eta=3.0")[
        "policy_loss_options"] == dict(sppo_eta=3.0)
    for mode in ("cispo", "geo_mean", "gpg", "gspo"):
        assert arguments(f"actor_rollout_ref.actor.policy_loss={mode}")["policy_loss_options"] == {}, mode
    # the shorthand followed by an option of the block keeps both, on the command line and in a file
    both = load_config(overrides=["actor_rollout_ref.actor.policy_loss=kl_cov",
                                  "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.5"]).actor_rollout_ref.actor
    assert (both.policy_loss.loss_mode, both.policy_loss.ppo_kl_coef) == ("kl_cov", 0.5)
    with pytest.raises(ConfigError, match="policy_loss.loss_mode='cispoo' is not one of"):
        load_config(overrides=["actor_rollout_ref.actor.policy_loss.loss_mode=cispoo"])


def test_every_shipped_recipe_validates():
    recipes = sorted((REPO / "configs").glob("*.yaml"))
    assert recipes, "configs/ ships recipes"
    for recipe in recipes:
        load_config(recipe)


def test_update_arguments_split_each_mini_batch_of_prompts_over_the_data_parallel_ranks():
    """verl's meaning: ppo_mini_batch_size counts prompts; each brings rollout.n responses; a rank holds its
    share of the data-parallel split. Built once per worker for the actor and the critic alike."""
    from megarl.controller.engine_specs import actor_update_arguments, critic_update_arguments

    cfg = load_config(overrides=["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=4",
                                 "actor_rollout_ref.actor.ppo_mini_batch_size=8", "critic.ppo_mini_batch_size=2",
                                 "critic.ppo_epochs=3", "critic.cliprange_value=0.7"])
    assert actor_update_arguments(cfg, dp_size=2)["mini_batch_size"] == 8 * 4 // 2
    critic = critic_update_arguments(cfg, dp_size=2)
    assert critic == dict(ppo_epochs=3, mini_batch_size=2 * 4 // 2, cliprange_value=0.7,
                          loss_agg_mode=cfg.critic.loss_agg_mode, replay_routing=False)


def test_megatron_overrides_reach_megatron_and_unknown_names_are_refused():
    from megarl.controller.engine_specs import ddp_config, megatron_optimizer_config

    cfg = load_config(None, [
        "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=true",
        "actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=0.75",
        "actor_rollout_ref.actor.megatron.override_ddp_config.grad_reduce_in_fp32=false",
        "actor_rollout_ref.actor.load_weight=false", "actor_rollout_ref.rollout.load_format=dummy"])
    actor = cfg.actor_rollout_ref.actor
    optimizer = megatron_optimizer_config(actor.optim, actor.megatron)
    assert optimizer.optimizer_cpu_offload is True and optimizer.optimizer_offload_fraction == 0.75
    assert optimizer.lr == actor.optim.lr  # the others are still megarl's
    assert ddp_config(actor.megatron).grad_reduce_in_fp32 is False
    with pytest.raises(ConfigError, match=r"override_optimizer_config\.optimizer_cpu_ofload: .*did you mean "
                                          r"'optimizer_cpu_offload'"):
        load_config(None, ["actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_ofload=true"])
    with pytest.raises(ConfigError, match=r"critic\.megatron\.override_ddp_config\.bucket_sise"):
        load_config(None, ["critic.megatron.override_ddp_config.bucket_sise=10"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.load_format"):
        load_config(None, ["actor_rollout_ref.rollout.load_format=random"])
    with pytest.raises(ConfigError, match=r"optimizer_cpu_offload=true moves .* trainer.device=cpu"):
        load_config(None, ["actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=true",
                           "trainer.device=cpu"])
    with pytest.raises(ConfigError, match=r"override_optimizer_config: expected a mapping"):
        load_config(None, ["actor_rollout_ref.actor.optim.override_optimizer_config=7"])


@pytest.mark.parametrize("correction, expected", [([], "token"), (["algorithm.rollout_correction.rollout_is=none"], None),
                                                  (["algorithm.rollout_correction.rollout_is=sequence"], "sequence"),
                                                  (["algorithm.rollout_correction.rollout_rs=token_k1",
                                                   "algorithm.rollout_correction.rollout_rs_threshold=2.0"], None)])
def test_fp8_rollout_turns_on_token_level_tis_unless_rollout_correction_is_configured(correction, expected):
    cfg = load_config(overrides=DEMO_SIZES + ["actor_rollout_ref.rollout.quantization=fp8"] + correction)
    assert cfg.algorithm.rollout_correction.rollout_is == expected
    assert load_config(overrides=DEMO_SIZES).algorithm.rollout_correction.rollout_is is None  # bf16: none
