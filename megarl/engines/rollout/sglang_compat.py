"""Everything in megarl that depends on which SGLang release is installed (issue 41): the tested range, the
engine's start-up arguments, and how a finished request reads. Tested with 0.5.17 on the GPU box (torch
2.11.0+cu130, sm90); SGLang has no CPU build for these machines (docs/sglang.md)."""

from __future__ import annotations

from typing import Optional

TESTED = ((0, 5, 17), (0, 5, 18))  # [lowest, first untested): 0.5.18 on pins a torch the box does not have


def sglang_version() -> tuple[int, ...]:
    import sglang

    return tuple(int(part) for part in sglang.__version__.split(".")[:3] if part.isdigit())


def check_supported_version() -> None:
    version = sglang_version()
    low, high = TESTED
    if not low <= version < high:
        import sglang

        raise RuntimeError(
            f"SGLangRolloutEngine: sglang {sglang.__version__} is installed; megarl's engine is tested with "
            f"{'.'.join(map(str, low))} up to (not including) {'.'.join(map(str, high))}: its generate, weight "
            "update and memory release calls changed shape across releases (megarl/engines/rollout/sglang_compat.py)")


def engine_arguments(model_path: str, *, tensor_parallel_size: int, gpu_memory_utilization: float,
                     enforce_eager: bool, dtype, max_model_len: Optional[int], seed: int,
                     enable_sleep_mode: bool, enable_prefix_caching: bool, load_format: str,
                     local_device_index: Optional[int], extra: dict) -> dict:
    """``sglang.Engine``'s keyword arguments (its ServerArgs) for megarl's engine options (``local_device_index``:
    the first of the GPUs SGLang's TP workers take, one each: ``base_gpu_id``). Token ids in and out
    (no tokenizer in the engine); the Triton attention and PyTorch sampling backends, the ones a box without
    FlashAttention-3 and flashinfer builds has; with sleep mode, the weights backed up to the host when
    released, since :meth:`SGLangRolloutEngine.sleep` must keep them unless told otherwise and SGLang decides
    that once, at start-up. ``dtype``: a name (``"auto"``, ``"bfloat16"``) or a torch dtype (SGLang takes names)."""
    if not isinstance(dtype, str):
        dtype = str(dtype).removeprefix("torch.")
    arguments = dict(model_path=model_path, skip_tokenizer_init=True, tp_size=tensor_parallel_size,
                     mem_fraction_static=gpu_memory_utilization, disable_cuda_graph=enforce_eager, dtype=dtype,
                     context_length=max_model_len, random_seed=seed, enable_memory_saver=enable_sleep_mode,
                     enable_weights_cpu_backup=enable_sleep_mode, disable_radix_cache=not enable_prefix_caching,
                     load_format=load_format, attention_backend="triton", sampling_backend="pytorch",
                     log_level="warning")
    if local_device_index is not None:
        arguments["base_gpu_id"] = local_device_index
    unknown = set(extra) & set(arguments)
    if unknown:
        raise ValueError(f"SGLangRolloutEngine: {sorted(unknown)} are set by megarl's own options "
                         "(actor_rollout_ref.rollout.*); pass those instead of SGLang's server arguments")
    return {**arguments, **extra}


def finish_reason(meta_info: dict, where: str) -> str:
    """``"stop"`` or ``"length"`` from a finished request's ``meta_info["finish_reason"]`` (``{"type": "stop",
    "matched": ...}``, ``{"type": "length", "length": n}``); an aborted request raises with SGLang's message."""
    reason = meta_info.get("finish_reason")
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind in ("stop", "length"):
        return kind
    message = reason.get("message") if isinstance(reason, dict) else None
    raise RuntimeError(f"SGLang finished {where} with {reason!r}" + (f": {message}" if message else ""))


def output_log_probs(meta_info: dict, token_ids: list[int], where: str) -> list[float]:
    """The sampled tokens' log-probs from ``meta_info["output_token_logprobs"]`` (``(logprob, token_id, text)``
    per generated token), checked against the tokens themselves."""
    entries = meta_info.get("output_token_logprobs")
    if entries is None or len(entries) != len(token_ids):
        raise RuntimeError(f"SGLang returned {None if entries is None else len(entries)} log-probs for {where}'s "
                           f"{len(token_ids)} tokens")
    for position, (entry, token) in enumerate(zip(entries, token_ids)):
        if int(entry[1]) != token:
            raise RuntimeError(f"SGLang's log-prob {position} of {where} is for token {entry[1]}, the output has {token}")
    return [float(entry[0]) for entry in entries]


def serialize_for_tp_worker(named_tensors: list[tuple[str, "torch.Tensor"]]) -> list[tuple[str, bytes]]:
    """This process's tensors as CUDA IPC handles for the SGLang TP worker on the same GPU, one per tensor (what
    SGLang's ``LocalSerializedTensor`` holds per rank), in the bucket's order. The device travels as its UUID
    (SGLang's torch patch, which its TP workers apply too): the worker sees the replica's GPUs where this process
    sees only its own, so a device index would name another GPU there. The caller keeps the tensors alive until
    the load returned."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()
    return [(name, MultiprocessingSerializer.serialize(tensor.detach())) for name, tensor in named_tensors]


def check_replica_payloads(names: list[str], payloads_by_rank: list[list[tuple[str, object]]]) -> None:
    """Every rank of the replica sent the first rank's bucket: the same tensors, in the same order."""
    for rank, payload in enumerate(payloads_by_rank):
        sent = [name for name, _ in payload]
        if sent != names:
            first = next((i for i, (a, b) in enumerate(zip(sent, names)) if a != b), min(len(sent), len(names)))
            raise RuntimeError(f"rollout replica: rank {rank} of the replica sent another bucket than its first rank "
                               f"({len(sent)} tensors against {len(names)}; position {first}: "
                               f"{sent[first] if first < len(sent) else None!r} against "
                               f"{names[first] if first < len(names) else None!r})")


def tensors_per_tp_worker(loads: list[tuple[str, int]], payloads_by_rank: list[list[tuple[str, bytes]]]):
    """``(name, LocalSerializedTensor)`` pairs for ``Engine.update_weights_from_tensor``: ``loads`` the names to
    load under and their positions in the ranks' buckets; TP worker i loads rank i's copy, from its own GPU."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor

    return [(name, LocalSerializedTensor(values=[payload[position][1] for payload in payloads_by_rank]))
            for name, position in loads]
