"""Let megatron-core run on CPU with the gloo backend (a debugging feature).

megatron-core assumes CUDA in a handful of hard-coded places. On a machine without a GPU we redirect
exactly those places, so the real Megatron engines (TP/PP/EP across 2-4 gloo processes) run on a
laptop or in CI:

* ``torch.cuda.current_device`` -> the CPU device (megatron allocates buffers on
  ``device=torch.cuda.current_device()``);
* the CUDA RNG state tracker in ``megatron.core.tensor_parallel.random`` -> a tracker over CPU
  generator states (the model-parallel seeds still differ per TP rank, as on GPU);
* the default causal mask (built with ``device="cuda"``) -> the same mask on CPU;
* ``torch.cuda.synchronize`` -> no-op (there is no stream to wait for);
* tensors the pipeline schedules create with ``device="cuda"`` (the token counter in
  ``megatron.core.pipeline_parallel.schedules``) -> CPU, through a module-local ``torch`` proxy;
* ``Tensor.cuda()`` -> the tensor itself (megatron moves e.g. the last stage's tied output weight
  "to the current device" with ``.cuda()`` before all-reducing it over the embedding group);
* ``torch.cuda.Stream`` / ``current_stream`` / ``stream(...)`` / ``Event`` -> one synchronous CPU
  "stream" whose waits and events are no-ops (the MoE all-to-all token dispatcher moves its split
  sizes to the host on a side stream);
* ``megatron.core.transformer.moe.moe_utils`` without Transformer Engine: 0.16 leaves ``te_general_gemm``
  (and the other fused TE kernels it imports) undefined but tests ``te_general_gemm is not None`` in the
  router GEMM; we define the missing names as None so the plain matmul path runs;
* ``megatron.core.transformer.multi_latent_attention.HAVE_TE`` -> False when Transformer Engine is not
  importable (megatron's TE extension imports with mock placeholders, so the MLA module believes TE is
  there and calls ``isinstance(..., <mock>)``);
* ``get_pos_emb_on_this_cp_rank`` (RoPE under context parallelism) -> the same chunk selection without
  the pinned host buffer it stages its two chunk indices in (pinning needs CUDA);
* ``moe_utils.maybe_move_tensor_to_cpu(..., as_numpy=True)`` -> also converts tensors already on CPU
  (on GPU the all-to-all split sizes become numpy arrays on their way to the host; on CPU they stayed
  tensors, which ``all_to_all_single`` rejects).

Megatron's pipeline schedules, optimizers and gradient clipping also create small bookkeeping tensors
with a literal ``device="cuda"`` and check ``param.type() == "torch.cuda.FloatTensor"``. Those are not
patched globally; callers wrap such megatron calls in :func:`cuda_tensors_on_cpu` (a scoped
``TorchFunctionMode`` that is a no-op unless CPU mode is on).

On a machine where CUDA is available, :func:`enable_cpu_compat` changes nothing. It is idempotent, and
:func:`applied_patches` says what it did. This module does not make CPU fast, nor does it cover fused
kernels, Transformer Engine or CUDA graphs; use the local layer spec on CPU.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

_APPLIED: list[str] = []


def applied_patches() -> list[str]:
    """Names of the redirections in force (empty on GPU machines or before enabling)."""
    return list(_APPLIED)


def is_cpu_mode() -> bool:
    return bool(_APPLIED)


class CpuRNGStatesTracker:
    """Megatron's named RNG-state tracker, over the CPU default generator.

    Megatron forks a named state (e.g. ``model-parallel-rng``) around dropout and sharded weight
    initialisation so that TP ranks draw different numbers while DP replicas draw the same ones; the
    same bookkeeping works with CPU generator states.
    """

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False):
        self.use_cudagraphable_rng = False
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = "default-rng"

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        outer_name = self._current_state_name
        if outer_name != "default-rng":
            self.states_[outer_name] = saved
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            if outer_name != "default-rng":
                saved = self.states_[outer_name]
            torch.set_rng_state(saved)
            self._current_state_name = outer_name


class _CudaTensorsOnCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites ``device="cuda"`` factory arguments to CPU, makes ``Tensor.cuda()`` the identity, and reports
    CPU tensor types under their CUDA names (megatron's optimizers dispatch on ``param.type()``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


def cuda_tensors_on_cpu():
    """Context for megatron calls that hard-code CUDA tensors (schedules, optimizer step, clipping)."""
    return _CudaTensorsOnCpuMode() if _APPLIED else contextlib.nullcontext()


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _patch_current_device() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


def _patch_synchronize() -> None:
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random.CudaRNGStatesTracker = CpuRNGStatesTracker
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, *args, **kwargs: torch.set_rng_state(new_state)
    # A tracker created before enabling (by an earlier import) would hold CUDA states.
    mcore_random.initialize_rng_tracker(force_reset=True)


def _patch_causal_mask() -> None:
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as transformer_utils

    transformer_utils.get_default_causal_mask = _cpu_causal_mask
    fused_softmax.get_default_causal_mask = _cpu_causal_mask


class _CpuDeviceTorch:
    """``torch`` as seen by one megatron module, with ``device="cuda"`` tensor factories sent to CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")

    def __getattr__(self, name):
        target = getattr(torch, name)
        if name not in self._FACTORIES:
            return target

        def factory(*args, device=None, **kwargs):
            if device is not None and torch.device(device).type == "cuda":
                device = "cpu"
            return target(*args, device=device, **kwargs)

        return factory


def _patch_schedules_cuda_tensors() -> None:
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuDeviceTorch()


class CpuStream:
    """Stands in for a CUDA stream on CPU, where every op is already synchronous. It also answers what vLLM's CPU
    worker asks of its own placeholder (``device``, ``query``, ``with stream:``), since one process may hold both."""

    device = torch.device("cpu")

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self) -> "CpuStream":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> "CpuEvent":
        return event if event is not None else CpuEvent()


class CpuEvent:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_DEFAULT_STREAM = CpuStream()


def _patch_streams() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    torch.cuda.Stream = CpuStream  # type: ignore[assignment,misc]
    torch.cuda.Event = CpuEvent  # type: ignore[assignment]
    torch.cuda.current_stream = lambda device=None: _CPU_DEFAULT_STREAM  # type: ignore[assignment]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    # The all-to-all dispatcher keeps the first stream any dispatcher made, in a class attribute, for the life of
    # the process, and synchronizes on the event it records: pin ours, whatever torch.cuda.Stream was then.
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = CpuStream()


_MOE_TE_NAMES = (
    "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
    "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
    "fused_unpermute", "te_general_gemm",
)


def _patch_moe_missing_te_names() -> None:
    from megatron.core.transformer.moe import moe_utils

    for name in _MOE_TE_NAMES:
        if not hasattr(moe_utils, name):
            setattr(moe_utils, name, None)


def _patch_mla_have_te() -> None:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        from megatron.core.transformer import multi_latent_attention

        multi_latent_attention.HAVE_TE = False


def _patch_moe_host_splits() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def move_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move_to_host
    token_dispatcher.maybe_move_tensor_to_cpu = move_to_host


def _cpu_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group) -> torch.Tensor:
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    chunks = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    mine = chunks.index_select(seq_dim, torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank]))
    return mine.reshape(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 1:])


def _patch_cp_pos_emb() -> None:
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding

    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        if hasattr(module, "get_pos_emb_on_this_cp_rank"):
            module.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank


def _patch_tensor_cuda() -> None:
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]


_PATCHES = (
    ("torch.cuda.current_device->cpu", _patch_current_device),
    ("torch.cuda.synchronize->noop", _patch_synchronize),
    ("megatron.tensor_parallel.random->cpu_rng", _patch_rng_tracker),
    ("megatron.default_causal_mask->cpu", _patch_causal_mask),
    ("megatron.pipeline_schedules.cuda_tensors->cpu", _patch_schedules_cuda_tensors),
    ("torch.Tensor.cuda->identity", _patch_tensor_cuda),
    ("torch.cuda.streams->synchronous_cpu", _patch_streams),
    ("megatron.moe_utils.missing_te_kernels->None", _patch_moe_missing_te_names),
    ("megatron.multi_latent_attention.HAVE_TE->False_without_te", _patch_mla_have_te),
    ("megatron.moe.all_to_all_splits->host_numpy", _patch_moe_host_splits),
    ("megatron.rope.cp_pos_emb->unpinned", _patch_cp_pos_emb),
)


def enable_cpu_compat(force: bool = False) -> list[str]:
    """Apply the CPU redirections unless CUDA is available (or ``force``). Returns applied names.

    Called again (every Megatron engine start is a call), it puts the stream patch back: vLLM's CPU worker, once
    imported (an in-process vLLM engine, a trainer.backend=inprocess run), replaces torch.cuda's streams with
    placeholders whose ``record_event`` returns None, on which Megatron's MoE dispatch then fails."""
    if _APPLIED:
        _patch_streams()
        return applied_patches()
    if torch.cuda.is_available() and not force:
        return []
    for name, apply in _PATCHES:
        apply()
        _APPLIED.append(name)
    logger.info("megatron CPU compatibility enabled: %s", ", ".join(_APPLIED))
    return applied_patches()
