"""Rollout engine on SGLang (``sglang.Engine``, tested with 0.5.17 on CUDA): token-id prompts in, sampled ids +
log-probs out (issue 41; `actor_rollout_ref.rollout.name=sglang`).

SGLang runs its scheduler (the model, the KV cache) in a process of its own; this process keeps its tokenizer
manager, which here is only a request router (``skip_tokenizer_init``: token ids in and out). So:

* weight updates cross processes as CUDA IPC handles of the caller's device tensors
  (``Engine.update_weights_from_tensor``): SGLang's scheduler maps the trainer's memory and loads from it, no
  host round trip; each call returns once SGLang has queued the bucket's copies (torch's IPC event orders them
  after the trainer's writes; what orders them before the trainer reuses the memory is the call's round trip,
  as in verl's and slime's use of the same call). Names and shapes are checked against the checkpoint first
  (:class:`~megarl.engines.rollout.weight_session.WeightUpdateSession`) and a session must carry the whole model,
  as for vLLM; the radix (prefix) cache is flushed when it closes;
* ``n`` samples of a prompt are ``n`` requests with seeds ``seed + prompt_index * n + j`` (or
  ``prompt_seeds[i] + j``), as the vLLM engine seeds them, through SGLang's per-request ``sampling_seed``, which
  SGLang 0.5.17 honours only in its deterministic mode (``enable_deterministic_inference``: batch-invariant
  kernels, slower); otherwise it samples from its own generator and the engine says so once;
* log-probs are SGLang's: ``log_softmax(logits / temperature)`` of the sampled token (greedy: of the logits),
  which is megarl's contract (``base.py``) without top-k/top-p; with those filters SGLang does not renormalize,
  so asking for log-probs and a filter is refused rather than returning another distribution's numbers;
* sleep releases the weights, the KV cache and the CUDA graphs (``release_memory_occupation``, SGLang's
  ``torch_memory_saver``); the weights are backed up to host memory when released, as ``sleep()`` must keep
  them unless told otherwise (SGLang fixes that at start-up, so ``discard_weights`` saves no copy here).

A replica over several GPUs (``tensor_parallel_size`` > 1) is this engine in the replica's first rank, whose
SGLang spawns one TP worker per GPU of the replica (``visible_devices``); the replica's other ranks hand it their
buckets as IPC handles of their own GPU's copies (:meth:`update_weights_from_replica`;
:mod:`megarl.controller.first_rank_replica` does the ranks' side).

Leaves out (refused by name): stop strings (no tokenizer in the engine: pass ``stop_token_ids``), stop token ids
beside ``ignore_eos`` (SGLang's ignore_eos switches them off too), LoRA adapters, images, the experts an MoE model
routed to.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import torch

from megarl.engines.rollout import sglang_compat
from megarl.engines.rollout.base import (RolloutEngine, RolloutOutput, SamplingConfig, check_prompt_seeds,
                                         first_sample_seed, validate_prompts)
from megarl.engines.rollout.process_env import environment_set
from megarl.engines.rollout.weight_session import WeightUpdateSession, fp8_checkpoint_block, read_checkpoint_shapes

logger = logging.getLogger(__name__)


def request_sampling_params(sampling: SamplingConfig, num_prompts: int) -> list[dict]:
    """SGLang's per-request sampling parameters, ``sampling.n`` requests per prompt in prompt order."""
    if sampling.stop:
        raise NotImplementedError("SGLangRolloutEngine: stop strings need a tokenizer in the engine, which megarl's "
                                  f"token-id engine does not start; got stop={list(sampling.stop)} (pass "
                                  "stop_token_ids, or generate with rollout.name=vllm)")
    if sampling.ignore_eos and sampling.stop_token_ids:
        raise NotImplementedError(
            f"SGLangRolloutEngine: ignore_eos with stop_token_ids={list(sampling.stop_token_ids)}: SGLang's "
            "ignore_eos switches off every stop token, not only the model's eos (megarl's contract keeps the stop "
            "ids); use rollout.name=vllm, or drop one of the two")
    filtered = sampling.top_p < 1.0 or sampling.top_k != -1
    if sampling.logprobs and filtered and not sampling.is_greedy:
        raise NotImplementedError(
            f"SGLangRolloutEngine: log-probs with top_p={sampling.top_p}, top_k={sampling.top_k}: SGLang returns "
            "the sampled token's log-prob before the filters renormalize, not under the distribution it sampled "
            "from (megarl's contract, base.py); use rollout.name=vllm for filtered sampling with log-probs")
    params = []
    for prompt_index in range(num_prompts):
        first_seed = first_sample_seed(sampling, prompt_index)
        for sample in range(sampling.n):
            param = dict(max_new_tokens=sampling.max_tokens, temperature=sampling.temperature,
                         top_p=sampling.top_p, top_k=sampling.top_k, ignore_eos=sampling.ignore_eos,
                         no_stop_trim=True)  # keep the stop token in the output, as the contract says
            if sampling.stop_token_ids:
                param["stop_token_ids"] = list(sampling.stop_token_ids)
            if first_seed is not None:
                param["sampling_seed"] = first_seed + sample
            params.append(param)
    return params


def positions_in_bucket(original: list, admitted: list) -> list[tuple[str, int]]:
    """``(name to load under, position in the bucket as sent)`` of what the weight session admitted: in order, a
    tied head's alias renamed or dropped, each tensor found back by identity (the ranks' copies are by position)."""
    position = {id(tensor): index for index, (_, tensor) in enumerate(original)}
    return [(name, position[id(tensor)]) for name, tensor in admitted]


def convert_outputs(results: list[dict], sampling: SamplingConfig, num_prompts: int) -> list[RolloutOutput]:
    """SGLang's finished requests (one per sample, in request order) as megarl's outputs."""
    if len(results) != num_prompts * sampling.n:
        raise RuntimeError(f"SGLang returned {len(results)} results for {num_prompts} prompts x {sampling.n} samples")
    outputs = []
    for request, result in enumerate(results):
        prompt_index = request // sampling.n
        where = f"sample {request % sampling.n} of prompt {prompt_index}"
        token_ids = [int(token) for token in result["output_ids"]]
        meta = result["meta_info"]
        log_probs = sglang_compat.output_log_probs(meta, token_ids, where) if sampling.logprobs else None
        outputs.append(RolloutOutput(prompt_index=prompt_index, token_ids=token_ids, log_probs=log_probs,
                                     finish_reason=sglang_compat.finish_reason(meta, where)))
    return outputs


class SGLangRolloutEngine(RolloutEngine):
    """``sglang.Engine`` behind the `RolloutEngine` interface."""

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        dtype="auto",
        max_model_len: Optional[int] = None,
        seed: int = 0,
        enable_sleep_mode: bool = False,
        enable_prefix_caching: bool = True,
        load_format: str = "auto",
        local_device_index: Optional[int] = None,
        visible_devices: Optional[list[str]] = None,
        server_args: Optional[dict] = None,
    ) -> None:
        """Start SGLang on the HF dir `model_path`. `gpu_memory_utilization` is SGLang's ``mem_fraction_static``
        (the device's share for weights and KV cache); `load_format="dummy"` starts from random weights, for a
        weight sync to fill. `server_args`: more of ``sglang.Engine``'s options (its ServerArgs fields, verl's
        ``rollout.engine_kwargs.sglang``), refused where they name one megarl sets from its own arguments;
        ``enable_deterministic_inference=True`` is what makes SGLang honour the samples' seeds.
        `visible_devices`: the GPUs (CUDA_VISIBLE_DEVICES entries) of a replica over several, one TP worker on
        each in order; SGLang's workers are started seeing those, whatever this process sees."""
        import sglang

        sglang_compat.check_supported_version()
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"SGLangRolloutEngine: model_path {model_path!r} is not a directory")
        config = json.loads((Path(model_path) / "config.json").read_text())
        if config.get("vision_config") is not None:
            raise NotImplementedError(f"SGLangRolloutEngine: {model_path} is a vision-language model; megarl serves "
                                      "those with rollout.name=vllm")
        self.vocab_size = int(config["vocab_size"])
        shapes = read_checkpoint_shapes(model_path, weights_on_disk=load_format != "dummy")
        self._session = WeightUpdateSession(type(self).__name__, shapes, tied=bool(config.get("tie_word_embeddings")),
                                            fp8_block=fp8_checkpoint_block(config, shapes))
        self._sleep_enabled = enable_sleep_mode
        if visible_devices is not None and len(visible_devices) != tensor_parallel_size:
            raise ValueError(f"SGLangRolloutEngine: {len(visible_devices)} visible_devices for tensor_parallel_size="
                             f"{tensor_parallel_size}")
        arguments = sglang_compat.engine_arguments(
            model_path, tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, dtype=dtype, max_model_len=max_model_len, seed=seed,
            enable_sleep_mode=enable_sleep_mode, enable_prefix_caching=enable_prefix_caching, load_format=load_format,
            local_device_index=0 if visible_devices is not None else local_device_index,
            extra=dict(server_args or {}))
        with _workers_see(visible_devices):
            self.engine = sglang.Engine(**arguments)
        # SGLang reads a request's sampling_seed only in its deterministic mode (batch-invariant kernels)
        self.honours_seeds = bool((server_args or {}).get("enable_deterministic_inference"))
        self._warned_seeds = False
        self._memory = "awake"  # awake | asleep | weights_only (the KV cache and CUDA graphs still released)

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 multi_modal_inputs: Optional[list[Optional[dict]]] = None) -> list[RolloutOutput]:
        self._check_ready("generate")
        if multi_modal_inputs is not None and any(multi_modal_inputs):
            raise NotImplementedError("SGLangRolloutEngine: prompts with images are served by rollout.name=vllm")
        validate_prompts(prompt_token_ids, self.vocab_size)
        check_prompt_seeds(prompt_token_ids, sampling)
        params = request_sampling_params(sampling, len(prompt_token_ids))
        seeded = not sampling.is_greedy and (sampling.seed is not None or bool(sampling.prompt_seeds))
        if seeded and not self.honours_seeds and not self._warned_seeds:
            logger.warning("SGLang samples without the given seeds unless started with enable_deterministic_inference "
                           "(actor_rollout_ref.rollout.engine_kwargs.sglang.enable_deterministic_inference=true, "
                           "slower batch-invariant kernels): a resumed run will not resample the same responses")
            self._warned_seeds = True
        requests = [list(ids) for ids in prompt_token_ids for _ in range(sampling.n)]
        results = self.engine.generate(input_ids=requests, sampling_params=params, return_logprob=sampling.logprobs)
        return convert_outputs(results, sampling, len(prompt_token_ids))

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket in SGLang's scheduler (CUDA IPC for device tensors); the session must deliver every
        checkpoint tensor before `finish_weight_update` (see :mod:`megarl.engines.rollout.weight_session`)."""
        bucket = self._admit(named_tensors)
        if bucket:
            # SGLang's loaders take the checkpoint's tensors; contiguous ones share their storage as one IPC handle
            bucket = [(name, tensor.contiguous()) for name, tensor in bucket]
            self._load(bucket, bucket)

    def update_weights_from_replica(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                    payloads_by_rank: list[list[tuple[str, bytes]]]) -> None:
        """One bucket of a replica over several GPUs, in its first rank: ``named_tensors`` this rank's own copies
        (checked as :meth:`update_weights` checks them), ``payloads_by_rank[i]`` rank i's copies of the same
        bucket as :func:`~megarl.engines.rollout.sglang_compat.serialize_for_tp_worker` wrote them, loaded by
        SGLang's TP worker i from rank i's GPU."""
        original = list(named_tensors)
        sglang_compat.check_replica_payloads([name for name, _ in original], payloads_by_rank)
        bucket = self._admit(original)
        if bucket:
            self._load(bucket, sglang_compat.tensors_per_tp_worker(positions_in_bucket(original, bucket),
                                                                   payloads_by_rank))

    def _admit(self, named_tensors):
        if self._memory == "asleep":
            raise RuntimeError("SGLangRolloutEngine.update_weights called while asleep; call wake_up() first "
                               "(wake_up(weights_only=True) is enough)")
        return self._session.admit(named_tensors)

    def _load(self, bucket, named_tensors) -> None:
        success, message = self.engine.update_weights_from_tensor(named_tensors=named_tensors, flush_cache=False)
        if not success:
            raise RuntimeError(f"SGLangRolloutEngine.update_weights: SGLang refused a bucket of {len(bucket)} "
                               f"tensors (first {bucket[0][0]!r}): {message}")
        self._session.loaded(bucket)

    def finish_weight_update(self) -> None:
        """Close the session (refused while checkpoint tensors are missing) and drop the radix cache, whose KV
        the old weights computed."""
        self._session.check_complete()
        self._session.close()
        self._flush_cache()

    def _flush_cache(self) -> None:
        result = self.engine.flush_cache()
        if getattr(result, "success", True) is False:
            raise RuntimeError(f"SGLang refused to flush its cache after a weight update: {result}")

    # ------------------------------------------------------------------ memory

    @property
    def supports_sleep(self) -> bool:
        return self._sleep_enabled

    def sleep(self, *, discard_weights: bool = False) -> None:
        """Release the weights (backed up to the host), the KV cache and the CUDA graphs."""
        if not self._sleep_enabled:
            raise NotImplementedError("SGLangRolloutEngine.sleep: the engine was built without enable_sleep_mode")
        if self._memory == "weights_only":
            raise RuntimeError("SGLangRolloutEngine.sleep called after wake_up(weights_only=True); call wake_up() first")
        if self._memory == "awake":
            self.engine.release_memory_occupation()
            self._memory = "asleep"

    def wake_up(self, *, weights_only: bool = False) -> None:
        """``weights_only``: the weights come back (to load new ones into), the KV cache and CUDA graphs later."""
        if not self._sleep_enabled:
            raise NotImplementedError("SGLangRolloutEngine.wake_up: the engine was built without enable_sleep_mode")
        if self._memory == "awake":
            return
        # SGLang maps its memory through its own allocator: what the trainer freed into PyTorch's cache here
        # would stay out of its reach (the same reason as vLLM's wake_up)
        torch.cuda.empty_cache()
        if self._memory == "asleep":
            self.engine.resume_memory_occupation(tags=["weights"])
            self._memory = "weights_only"
        if not weights_only:
            self.engine.resume_memory_occupation(tags=["kv_cache", "cuda_graph"])
            self._memory = "awake"

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None

    def _check_ready(self, what: str) -> None:
        if self.engine is None:
            raise RuntimeError(f"SGLangRolloutEngine.{what} called after shutdown()")
        if self._memory != "awake":
            raise RuntimeError(f"SGLangRolloutEngine.{what} called while asleep; call wake_up() first")
        if self._session.open:
            raise RuntimeError(f"SGLangRolloutEngine.{what} called during a weight update; "
                               "call finish_weight_update() first")


def _workers_see(visible_devices: Optional[list[str]]):
    """SGLang's TP workers are processes it starts, with this process's environment at their start: with
    ``visible_devices`` they see those GPUs (this process, whose CUDA is already up, keeps its own)."""
    return environment_set({} if visible_devices is None else {"CUDA_VISIBLE_DEVICES": ",".join(visible_devices)})
