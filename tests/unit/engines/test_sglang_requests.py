"""The CPU-testable parts of megarl's SGLang engine (SGLang itself runs on the GPU box only, tests/gpu/
test_sglang_cuda.py): the requests it builds from megarl's sampling settings, how SGLang's finished requests read
back, its start-up arguments, and what the config refuses with rollout.name=sglang."""

from __future__ import annotations

import pytest
import torch

from megarl.engines.rollout import sglang_compat
from megarl.engines.rollout.base import SamplingConfig
from megarl.engines.rollout.sglang_engine import convert_outputs, positions_in_bucket, request_sampling_params
from megarl.engines.rollout.weight_session import WeightUpdateSession


def test_n_samples_are_n_requests_seeded_like_the_vllm_engine():
    params = request_sampling_params(SamplingConfig(n=3, seed=10, max_tokens=7, temperature=0.8), num_prompts=2)
    assert [p["sampling_seed"] for p in params] == [10, 11, 12, 13, 14, 15]
    assert all(p["max_new_tokens"] == 7 and p["temperature"] == 0.8 and p["no_stop_trim"] for p in params)
    per_prompt = request_sampling_params(SamplingConfig(n=2, prompt_seeds=(100, 7)), num_prompts=2)
    assert [p["sampling_seed"] for p in per_prompt] == [100, 101, 7, 8]
    unseeded = request_sampling_params(SamplingConfig(n=2, stop_token_ids=(5,)), num_prompts=1)
    assert all("sampling_seed" not in p and p["stop_token_ids"] == [5] for p in unseeded)


def test_what_the_token_id_engine_cannot_honour_is_refused_by_name():
    with pytest.raises(NotImplementedError, match="stop strings"):
        request_sampling_params(SamplingConfig(stop=("###",)), num_prompts=1)
    with pytest.raises(NotImplementedError, match="ignore_eos with stop_token_ids=\\[7\\]"):
        request_sampling_params(SamplingConfig(ignore_eos=True, stop_token_ids=(7,)), num_prompts=1)
    with pytest.raises(NotImplementedError, match="top_p=0.9"):
        request_sampling_params(SamplingConfig(top_p=0.9, logprobs=True), num_prompts=1)
    # without log-probs the filters are SGLang's to apply; greedy log-probs are the plain log-softmax
    assert request_sampling_params(SamplingConfig(top_k=20), num_prompts=1)[0]["top_k"] == 20
    request_sampling_params(SamplingConfig(temperature=0.0, top_k=5, logprobs=True), num_prompts=1)


def result(ids, reason, logprobs=None):
    meta = {"finish_reason": reason}
    if logprobs is not None:
        meta["output_token_logprobs"] = logprobs
    return {"output_ids": ids, "meta_info": meta}


def test_finished_requests_read_back_grouped_by_prompt():
    sampling = SamplingConfig(n=2, logprobs=True)
    results = [result([5, 2], {"type": "stop", "matched": 2}, [(-0.5, 5, None), (-1.0, 2, None)]),
               result([6, 7], {"type": "length", "length": 2}, [(-0.1, 6, None), (-0.2, 7, None)]),
               result([8], {"type": "stop", "matched": 8}, [(-3.0, 8, None)]),
               result([9, 9], {"type": "length", "length": 2}, [(-0.3, 9, None), (-0.4, 9, None)])]
    outputs = convert_outputs(results, sampling, num_prompts=2)
    assert [o.prompt_index for o in outputs] == [0, 0, 1, 1]
    assert [o.finish_reason for o in outputs] == ["stop", "length", "stop", "length"]
    assert outputs[0].token_ids == [5, 2] and outputs[0].log_probs == [-0.5, -1.0]
    assert convert_outputs(results, SamplingConfig(n=2), num_prompts=2)[1].log_probs is None


def test_a_bad_answer_names_the_sample():
    with pytest.raises(RuntimeError, match="3 results for 2 prompts x 2 samples"):
        convert_outputs([result([1], "length")] * 3, SamplingConfig(n=2), num_prompts=2)
    with pytest.raises(RuntimeError, match="sample 1 of prompt 0 with .*abort.*out of memory"):
        convert_outputs([result([1], {"type": "length"}), result([], {"type": "abort", "message": "out of memory"})],
                        SamplingConfig(n=2), num_prompts=1)
    with pytest.raises(RuntimeError, match="log-prob 1 of sample 0 of prompt 0 is for token 4, the output has 3"):
        convert_outputs([result([2, 3], "length", [(-1.0, 2, None), (-1.0, 4, None)])],
                        SamplingConfig(logprobs=True), num_prompts=1)
    with pytest.raises(RuntimeError, match="1 log-probs for sample 0 of prompt 0's 2 tokens"):
        convert_outputs([result([2, 3], "length", [(-1.0, 2, None)])], SamplingConfig(logprobs=True), num_prompts=1)


def test_start_up_arguments():
    arguments = sglang_compat.engine_arguments(
        "/m", tensor_parallel_size=1, gpu_memory_utilization=0.4, enforce_eager=True, dtype=torch.bfloat16,
        max_model_len=1024, seed=3, enable_sleep_mode=True, enable_prefix_caching=False, load_format="dummy",
        local_device_index=2, extra={"chunked_prefill_size": 4096})
    assert arguments["skip_tokenizer_init"] and arguments["disable_cuda_graph"] and arguments["disable_radix_cache"]
    assert arguments["enable_memory_saver"] and arguments["enable_weights_cpu_backup"]
    assert arguments["dtype"] == "bfloat16"  # the trainer's torch dtype, as SGLang names it
    assert (arguments["mem_fraction_static"], arguments["context_length"], arguments["random_seed"],
            arguments["base_gpu_id"], arguments["load_format"], arguments["chunked_prefill_size"]) == (
        0.4, 1024, 3, 2, "dummy", 4096)
    with pytest.raises(ValueError, match="random_seed"):
        sglang_compat.engine_arguments("/m", tensor_parallel_size=1, gpu_memory_utilization=0.4,
                                       enforce_eager=False, dtype="auto", max_model_len=None, seed=0,
                                       enable_sleep_mode=False, enable_prefix_caching=True, load_format="auto",
                                       local_device_index=None, extra={"random_seed": 1})


@pytest.mark.parametrize("override,key", [
    ("actor_rollout_ref.rollout.stop=[x]", "actor_rollout_ref.rollout.stop"),
    ("actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
     "actor_rollout_ref.rollout.enable_rollout_routing_replay"),
    ("actor_rollout_ref.rollout.quantization=fp8", "actor_rollout_ref.rollout.quantization"),
])
def test_the_config_refuses_what_the_sglang_engine_leaves_out(override, key):
    from megarl.config import ConfigError
    from megarl.run_config import load_config

    with pytest.raises(ConfigError, match=key):
        load_config("configs/grpo_tiny.yaml", ["actor_rollout_ref.rollout.name=sglang", override])
    load_config("configs/grpo_tiny.yaml", ["actor_rollout_ref.rollout.name=sglang"])


def test_sglangs_own_options_travel_under_verls_key_and_only_to_sglang():
    from megarl.config import ConfigError
    from megarl.run_config import load_config

    cfg = load_config("configs/grpo_tiny.yaml", ["actor_rollout_ref.rollout.name=sglang",
                                                 "actor_rollout_ref.rollout.engine_kwargs.sglang.chunked_prefill_size=4096"])
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.sglang == {"chunked_prefill_size": 4096}
    with pytest.raises(ConfigError, match="engine_kwargs.sglang is set .*chunked_prefill_size.* set actor_rollout_ref.rollout.name=sglang"):
        load_config("configs/grpo_tiny.yaml", ["actor_rollout_ref.rollout.engine_kwargs.sglang.chunked_prefill_size=4096"])


def test_a_replicas_copies_are_found_by_their_place_in_the_bucket_the_ranks_sent():
    # a tied model's bucket with the head's alias after the embedding: the session drops the alias, and each
    # tensor the first rank loads takes the ranks' copies at its own position in what they sent
    shapes = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,)}
    sent = [("model.norm.weight", torch.ones(4)), ("model.embed_tokens.weight", torch.zeros(8, 4)),
            ("lm_head.weight", torch.zeros(8, 4))]
    admitted = WeightUpdateSession("Engine", shapes, tied=True).admit(sent)
    assert positions_in_bucket(sent, admitted) == [("model.norm.weight", 0), ("model.embed_tokens.weight", 1)]
    head_first = [sent[2], sent[0]]
    admitted = WeightUpdateSession("Engine", shapes, tied=True).admit(head_first)
    assert positions_in_bucket(head_first, admitted) == [("model.embed_tokens.weight", 0), ("model.norm.weight", 1)]


def test_ranks_that_sent_another_bucket_are_named():
    names = ["a", "b", "c"]
    sglang_compat.check_replica_payloads(names, [[(n, b"") for n in names]] * 2)
    with pytest.raises(RuntimeError, match=r"rank 1 .* position 2: None against 'c'"):
        sglang_compat.check_replica_payloads(names, [[(n, b"") for n in names], [("a", b""), ("b", b"")]])
    with pytest.raises(RuntimeError, match=r"rank 0 .* position 0: 'b' against 'a'"):
        sglang_compat.check_replica_payloads(names, [[("b", b""), ("a", b""), ("c", b"")]])


def test_a_replica_over_several_gpus_stays_on_one_node():
    from megarl.config import ConfigError
    from megarl.run_config import load_config

    two_gpus = ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                "trainer.device=cuda"]
    load_config(None, two_gpus + ["trainer.n_gpus_per_node=2"])  # one replica on the node's two GPUs
    with pytest.raises(ConfigError, match=r"must divide trainer.n_gpus_per_node=1 with rollout.name=sglang"):
        load_config(None, two_gpus + ["trainer.n_gpus_per_node=1", "trainer.nnodes=2"])
    with pytest.raises(ConfigError, match="trainer.placement=colocate"):
        load_config(None, two_gpus + ["trainer.n_gpus_per_node=2", "trainer.placement=separate",
                                      "trainer.rollout_gpus=2", "trainer.nnodes=2"])


def test_the_packages_sglang_extra_is_the_tested_range():
    import re

    from tests.paths import REPO

    low, high = (".".join(map(str, bound)) for bound in sglang_compat.TESTED)
    extra = re.search(r'"sglang": \["sglang>=([\d.]+),<([\d.]+)"\]', (REPO / "setup.py").read_text())
    assert extra is not None and extra.groups() == (low, high)
