"""Per-GPU memory plan of one RL step (rollout, log-prob passes, actor/critic training) for a parallel layout.

Everything is bytes on the worst GPU of each pipeline stage; the plan takes the max over stages and phases.

Training state (Megatron DDP with fp32 grad buffers, Adam):
  params p B/param (2 bf16, 4 fp32); main grads 4 B/param (Megatron's full-size fp32 grad buffer, not sharded
  even with the distributed optimizer; ``grad_bytes`` 2 without grad_reduce_in_fp32); optimizer fp32 Adam m + v
  (8 B/param) plus, for bf16 params, the fp32 master copy Megatron's Float16OptimizerWithFloat16Params keeps
  (12 B/param in all), divided by the data-parallel size (dense weights: dp*cp, routed experts: expert_dp) when
  the distributed optimizer is on. With megatron's CPU-offloaded optimizer (HybridDeviceOptimizer, fraction f on
  the host) each of its parameters also keeps an fp32 copy of its grad (4 B): the host holds f x 16 B/param
  (pinned grads included), the GPU (1 - f) x 16 B/param, alive across steps. Host memory of a node is that
  host share plus what the rollout phase parks there (params, the GPU optimizer share; grads are dropped), per
  GPU of the node, plus each worker process's own resident memory (``host_process_overhead_gib``: torch's,
  CUDA's and megatron's libraries and the in-process rollout engine's; 2.9 GiB beyond the parked base in the 14B
  LoRA run's worker at its first generation on the H100, docs/benchmarks.md), plus, where the colocated engine
  keeps its weights through sleep (a served LoRA adapter), its pinned copy of them
  (:func:`rollout_weights_host_copy`); checked when ``host_memory_gib`` is given.
  Measured for this case: the 7B run on one H100 (docs/benchmarks.md, "7B on one GPU"): rollout, log-prob and
  update phases within 0.2-2.7% (tests/unit/plan/test_offloaded_optimizer_plan.py).
  Parameters on a GPU: TP-split weights / tp + replicated weights + routed experts /
  (ep*etp); the embedding on the first stage and the output head on the last (a tied embedding gets a copy
  there when pp > 1), vocab padded to a multiple of 128*tp as Megatron does.

Activations, per layer and micro-batch of T = b*s/cp tokens, a = p bytes per activation entry (activations
are in the params dtype), nd = tp with sequence parallel else 1, a/t query heads and max(g/t, 1) kv heads of
width D per rank (q = width of the local query heads, kv of the local kv heads):
  GQA attention, flash  a*T*(2h/nd + 2q + 2kv) + 4T*a/t   (norm input, qkv input, Q K V, core-attn output; lse fp32)
                 + a*T*(q + kv) with Qwen3 q/k norms
  GQA attention, materialized (megatron's local DotProductAttention: baddbmm scores, masked softmax, bmm):
                 a*T*(2h/nd + 4q) + b*(a/t)*s^2*(4 + a)     (K and V repeated to every query head; the fp32
                 softmax output and its cast back to a bytes are both kept; in fp32 they are one tensor: 4 B)
                 plus one persistent [b*a/t, s, s] score buffer (megatron's global memory buffer)
  MLA attention  a*T*(2h/nd + 2*q_lora + 2*(kv_lora + rope)) + a*T*(a/t)*(2*(nope+rope) + v) + ... + 4T*a/t
  dense SwiGLU   a*T*(2h/nd + 3f/t)            fused (norm input, fc1 input, fc1 output 2f, act output f)
                 a*T*(2h/nd + 5f/t)            unfused torch ops keep silu(x1) and x2 + glu_linear_offset too
  RMSNorm        fused keeps its input; torch's composite (the CPU path) also keeps the normalised copy in
                 fp32 and, for 16-bit inputs, an fp32 upcast instead of the input: + T*h*(4 + (4 - a)) each
  MoE            a*T*2h/nd + 4T*E/nd + a*(T/nd)*k*(etp*h + 3f_e) + a*T*3f_s/t   (router logits fp32, routed
                 tokens through top-k experts, shared experts)
  selective recompute (Megatron core_attn + moe_act + mla_up_proj): drops the routed act output (f_e), MLA's
  decompressed Q K V and the materialized scores; with flash attention core_attn adds nothing for GQA. Full
  recompute ("uniform", groups of n layers; megarl's default n = 1) keeps a*T*h/nd per group plus one group's full
  activations as the recompute working set; "block" (the first n layers of each virtual chunk recomputed) keeps
  a*T*h/nd for those and every activation of the other layers, plus one recomputed layer's working set.
  In flight on stage r (Megatron 1F1B): min(pp - r, M) micro-batches; interleaved with vpp=v:
  min(2(pp - r - 1) + (v - 1)pp + 1, M*v) chunks of 1/v of the stage.
Logits (last stage, one micro-batch of b rows, N = b * response tokens, V' = padded vocab / tp): the model's
  logits a*b*s*V', for b > 1 unpacked rows a contiguous copy of the response slice a*N*V' (a packed stream is
  scored whole, N = its tokens, no copy), and at TP > 1 the three fp32 [N, V'] buffers megarl's vocab-parallel
  log-prob function holds at its forward peak (shifted logits, exp, exp * logits): 12*N*V', with or without
  grad. At TP = 1 (megarl's chunked path) one fp32 chunk of 2**28 logits, and with grad two more logits-sized
  tensors in the logits' dtype (the function's grad of what it read, and the model output's grad it is
  scattered into). Log-prob (no grad) passes count one layer's activations plus this, at their own micro-batch
  (its own token budget when packing). The worker brings the whole actor back (params, grads, optimizer) before its
  log-prob pass, so that phase counts all of it. An engine that builds explicit [b, 1, s, s] boolean masks keeps M
  of them on the GPU.

Rollout engine (vLLM-style): weights (params / rollout_tp at rollout_weight_bytes) + KV cache; GQA KV per token
= 2 * layers * kv_heads_per_rank * head_dim * bytes, MLA per token = layers * (kv_lora_rank + rope_dim) * bytes
(the latent is not split over TP). The engine reserves gpu_memory_utilization of the GPU.
Colocated: with offload_train_state the actor/ref/critic states leave the GPU outside their own phase (verl's
param/grad/optimizer offload, slime's colocate); with rollout_sleeps the engine frees weights and KV cache while
training (vLLM sleep mode). Whatever is not offloaded is counted in every phase.
A fixed framework_overhead_gib (CUDA context, NCCL buffers, allocator cache and fragmentation: what
``nvidia-smi`` sees beyond ``torch.cuda.max_memory_allocated``) is added to every phase; use 0 to compare with
the allocator's own peak. ``KernelSpec`` says which kernels run (flash vs materialized attention, fused vs
torch-composite SwiGLU/RMSNorm); ``KernelSpec.megatron_local`` is megarl's local-spec engine as it runs today.
Leaves out: host memory of the driver, Ray and the page cache, dynamic batching,
activation offload, FP8 training, pipeline bubbles in time, the
optimizer step's transients beyond torch's foreach Adam's one fp32 tensor the size of what it steps on the device
(counted where it exceeds the activations it follows: the 7B run with 25% of Adam on the GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from megarl.plan.layout import LayoutSpec, TrainingSpec, check_layout, split_pipeline_layers
from megarl.models.model_dims import ModelDims, read_model_dims
from megarl.plan.param_count import LayerParams, ParamCount, count_parameters

GIB = 1024**3
GRAD_BYTES = 4
ADAM_STATE_BYTES = 8  # fp32 exp_avg + exp_avg_sq
MASTER_PARAM_BYTES = 4  # fp32 copy of 16-bit params (Float16OptimizerWithFloat16Params / distributed optimizer)
LOGPROB_FP32_BUFFERS = 3  # megarl.engines.megatron.logprob forward peak: shifted logits, exp, exp * logits
TP1_CHUNK_ELEMENTS = 2**28  # megarl.engines.megatron.logprob._CHUNK_ELEMENTS: the TP = 1 path's fp32 chunk


def optimizer_bytes_per_param(param_bytes: int) -> int:
    """Adam states, plus the fp32 master copy when the model's params are 16-bit."""
    return ADAM_STATE_BYTES + (MASTER_PARAM_BYTES if param_bytes < 4 else 0)


@dataclass(frozen=True)
class KernelSpec:
    """Which kernels the training step runs: they decide what autograd keeps for the backward.

    The default is a Transformer-Engine-style step (flash attention, fused SwiGLU and RMSNorm, causal mask
    generated in the kernel). ``megatron_local`` is megatron-core's local layer spec without TE or apex.
    """

    attention: Literal["flash", "materialized"] = "flash"
    fused_swiglu: bool = True
    rmsnorm: Literal["fused", "composite"] = "fused"
    explicit_attention_mask: bool = False  # the engine ships [b, 1, s, s] bool masks to the GPU
    # megarl's log-prob function at TP = 1: "chunked" (fp32 chunks of 2**28 logits) since f5ac0c1;
    # "fp32_buffers" (three fp32 [N, V] buffers, as at TP > 1) is what the H200 updates recorded before it ran
    log_prob: Literal["chunked", "fp32_buffers"] = "chunked"

    @classmethod
    def megatron_local(cls, *, rmsnorm: Literal["fused", "composite"] = "composite",
                       log_prob: Literal["chunked", "fp32_buffers"] = "chunked") -> "KernelSpec":
        """megarl's engine on the local spec: materialized DotProductAttention, unfused SwiGLU (the bridge
        turns the fusions off), torch RMSNorm (composite on CPU), explicit masks of padded micro-batches
        (:func:`megarl.engines.megatron.packing.pad_rows`)."""
        return cls(attention="materialized", fused_swiglu=False, rmsnorm=rmsnorm, explicit_attention_mask=True,
                   log_prob=log_prob)

    def __post_init__(self):
        if self.attention not in ("flash", "materialized"):
            raise ValueError(f"KernelSpec.attention must be 'flash' or 'materialized', got {self.attention!r}")
        if self.rmsnorm not in ("fused", "composite"):
            raise ValueError(f"KernelSpec.rmsnorm must be 'fused' or 'composite', got {self.rmsnorm!r}")
        if self.log_prob not in ("chunked", "fp32_buffers"):
            raise ValueError(f"KernelSpec.log_prob must be 'chunked' or 'fp32_buffers', got {self.log_prob!r}")


@dataclass
class PhaseMemory:
    """Bytes per component of one phase on one GPU of one pipeline stage."""

    phase: str
    stage: int
    components: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.components.values())


@dataclass
class PlanReport:
    fits: bool
    errors: list[str]
    warnings: list[str]
    gpu_memory_gib: float
    params: ParamCount | None = None
    phases: list[PhaseMemory] = field(default_factory=list)  # worst stage of each phase
    peak: PhaseMemory | None = None
    stage_layers: list[int] = field(default_factory=list)
    dp: int = 0
    expert_dp: int = 0
    num_micro_batches: int = 0
    rollout_kv_tokens_capacity: int = 0
    host: dict[str, float] = field(default_factory=dict)  # host memory of one node by component

    @property
    def host_total(self) -> float:
        return sum(self.host.values())

    @property
    def peak_gib(self) -> float:
        return self.peak.total / GIB if self.peak else 0.0

    def table(self) -> str:
        """Human-readable plan: the layout's derived sizes, then each phase's worst-GPU components."""
        lines = []
        if self.params is not None:
            p = self.params
            lines.append(
                f"model: {p.total / 1e9:.2f}B params, {p.active / 1e9:.2f}B active"
                + (f", MTP {p.mtp / 1e9:.2f}B (total with MTP {p.total_with_mtp / 1e9:.2f}B)" if p.mtp else "")
            )
        if self.stage_layers:
            lines.append(
                f"dp={self.dp} expert_dp={self.expert_dp} micro_batches/step={self.num_micro_batches} "
                f"layers per stage={self.stage_layers}"
            )
        for phase in self.phases:
            lines.append(f"[{phase.phase}] worst GPU: pipeline stage {phase.stage}, {phase.total / GIB:.2f} GiB")
            for name, value in phase.components.items():
                lines.append(f"    {name:<34} {value / GIB:10.2f} GiB")
        if self.rollout_kv_tokens_capacity:
            lines.append(f"rollout KV cache capacity per engine: {self.rollout_kv_tokens_capacity:,} tokens")
        if self.host:
            lines.append(f"[host] one node: {self.host_total / GIB:.2f} GiB")
            for name, value in self.host.items():
                lines.append(f"    {name:<34} {value / GIB:10.2f} GiB")
        if self.peak is not None:
            lines.append(
                f"peak: {self.peak_gib:.2f} GiB of {self.gpu_memory_gib:.2f} GiB "
                f"({self.peak.phase}, stage {self.peak.stage})"
            )
        lines += [f"WARNING: {w}" for w in self.warnings]
        lines += [f"ERROR: {e}" for e in self.errors]
        lines.append("FITS" if self.fits else "DOES NOT FIT")
        return "\n".join(lines)


def pad_vocab(vocab_size: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of 128 * tp so every TP shard is aligned."""
    multiple = 128 * tp
    return -(-vocab_size // multiple) * multiple


def lora_params_per_layer(dims: ModelDims, rank: int, targets) -> int:
    """Adapter parameters of one decoder layer: ``rank * (in + out)`` per adapted linear (dense MLP shapes; an
    MoE layer's experts are counted as one dense MLP, so this undercounts expert adapters)."""
    h, heads, kv, hd, ffn = dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim, dims.intermediate_size
    shapes = {"linear_qkv": (h, (heads + 2 * kv) * hd), "linear_proj": (heads * hd, h),
              "linear_fc1": (h, 2 * ffn), "linear_fc2": (ffn, h)}
    return sum(rank * (i + o) for name, (i, o) in shapes.items() if name in targets)


def _layer_gpu_params(layer: LayerParams, layout: LayoutSpec) -> tuple[float, float]:
    """(dense, expert) parameters of ``layer`` on one GPU."""
    dense = layer.tp_sharded / layout.parallel.tensor_parallel + layer.replicated
    p = layout.parallel
    expert = layer.routed_experts / (p.expert_parallel * p.effective_expert_tensor_parallel)
    return dense, expert


def _attention_activation_bytes(
    dims: ModelDims, layout: LayoutSpec, tokens: int, recompute: str, seq_len: int, a: int, kernels: KernelSpec
) -> float:
    t, h = layout.parallel.tensor_parallel, dims.hidden_size
    nd = t if layout.sequence_parallel and t > 1 else 1
    heads = dims.num_heads / t
    lse = 4 * tokens * heads
    if dims.mla is not None:
        m = dims.mla
        latents = a * tokens * (2 * h / nd + 2 * (m.q_lora_rank or 0) + 2 * (m.kv_lora_rank + m.qk_rope_head_dim))
        qkv = a * tokens * heads * (2 * (m.qk_nope_head_dim + m.qk_rope_head_dim) + m.v_head_dim)
        core_out = a * tokens * heads * m.v_head_dim
        # mla_up_proj recompute rebuilds Q, K, V from the latents in the backward.
        return latents + core_out + lse + (0 if recompute == "selective" else qkv)
    q = heads * dims.head_dim
    kv = max(dims.num_kv_heads // t, 1) * dims.head_dim
    norms = a * tokens * (h / nd) * (1 + _norm_extra_entries(a, kernels))
    if kernels.attention == "flash":
        total = norms + a * tokens * (h / nd + 2 * q + 2 * kv) + lse
    else:
        # baddbmm keeps Q and K, bmm keeps the probabilities and V, out-projection keeps the context. With
        # GQA, K and V are repeat_interleave'd to every query head first (q wide each) and the fused qkv
        # output is freed; without GQA, V is a view that keeps the whole qkv output alive.
        qkv_kept = 3 * q if dims.num_heads > dims.num_kv_heads else 2 * q + 3 * kv
        total = norms + a * tokens * (h / nd + qkv_kept + q)
        if recompute != "selective":  # core_attn recompute rebuilds the scores in the backward
            total += tokens * seq_len * heads * _score_bytes_per_entry(a)
    if dims.qk_norm:
        total += a * tokens * (q + kv)
    return total


def _score_bytes_per_entry(a: int) -> int:
    """Materialized attention keeps the fp32 softmax output and, for 16-bit models, its cast back."""
    return 4 + (a if a < 4 else 0)


def _norm_extra_entries(a: int, kernels: KernelSpec) -> float:
    """Extra [T, h] entries (in units of ``a`` bytes) torch's composite RMSNorm keeps beyond its input."""
    if kernels.rmsnorm == "fused":
        return 0.0
    return (4 + (4 - a)) / a


def _mlp_activation_bytes(
    dims: ModelDims, layout: LayoutSpec, tokens: int, is_moe: bool, recompute: str, a: int, kernels: KernelSpec
) -> float:
    t, h = layout.parallel.tensor_parallel, dims.hidden_size
    nd = t if layout.sequence_parallel and t > 1 else 1
    norm = a * tokens * (h / nd) * (1 + _norm_extra_entries(a, kernels))
    if not is_moe:
        width = 3 if kernels.fused_swiglu else 5
        return norm + a * tokens * (h / nd + width * dims.intermediate_size / t)
    moe = dims.moe
    assert moe is not None
    routed_width = 2 if recompute == "selective" else 3  # moe_act recompute drops the activation output
    etp = layout.parallel.effective_expert_tensor_parallel
    routed = a * (tokens / nd) * moe.experts_per_token * (etp * h + routed_width * moe.expert_intermediate_size)
    shared = a * tokens * 3 * moe.shared_expert_intermediate_size / t
    router = 4 * tokens * moe.num_experts / nd
    return norm + a * tokens * h / nd + router + routed + shared


def layer_activation_bytes(
    dims: ModelDims, layout: LayoutSpec, tokens: int, is_moe: bool, recompute: str, *,
    seq_len: int | None = None, activation_bytes: int = 2, kernels: KernelSpec = KernelSpec(),
) -> float:
    """Activation bytes one decoder layer keeps for the backward, for ``tokens`` tokens on this GPU.

    ``seq_len`` (the keys each query attends to) is needed for materialized attention only.
    """
    if kernels.attention == "materialized" and seq_len is None:
        raise ValueError("layer_activation_bytes: materialized attention needs seq_len")
    a = activation_bytes
    return _attention_activation_bytes(dims, layout, tokens, recompute, seq_len or 0, a, kernels) + (
        _mlp_activation_bytes(dims, layout, tokens, is_moe, recompute, a, kernels)
    )


def logits_bytes(dims: ModelDims, layout: LayoutSpec, training: TrainingSpec, *, with_grad: bool = True,
                 rows: int | None = None, kernels: KernelSpec = KernelSpec()) -> float:
    """Peak bytes of one micro-batch's logits through megarl's log-prob function (``rows``: of max_seq_len, the
    training micro-batch's unless given). At TP = 1 the chunked path holds one fp32 chunk of 2**28 logits at a
    time, and with grad its backward adds two logits-sized tensors in the logits' dtype: its own grad of what it
    read, and the model output's grad that slicing scatters it into (the 7B LoRA update on an H100 measured
    these: docs/benchmarks.md, "Planner vs measured memory"). At TP > 1, three fp32 [N, V/tp] buffers."""
    tp = layout.parallel.tensor_parallel
    vocab = pad_vocab(dims.vocab_size, tp) / tp
    rows = rows or training.micro_batch_size
    positions = rows * training.max_seq_len // layout.parallel.context_parallel
    a = training.param_bytes
    model_logits = a * positions * vocab
    if training.sequence_packing:
        response, slice_copy = positions, 0  # the whole stream is scored in place
    else:
        response = rows * (training.max_response_len or training.max_seq_len)
        # A [b, R] slice of [b, s, V] logits is contiguous only for b == 1; otherwise reshape copies it.
        slice_copy = a * response * vocab if rows > 1 else 0
    if tp > 1 or kernels.log_prob == "fp32_buffers":
        return model_logits + slice_copy + 4 * LOGPROB_FP32_BUFFERS * response * vocab
    chunk = 4 * min(TP1_CHUNK_ELEMENTS, response * vocab)
    if not with_grad:
        return model_logits + slice_copy + chunk
    return model_logits + slice_copy + a * response * vocab + a * positions * vocab + chunk


def attention_side_bytes(dims: ModelDims, layout: LayoutSpec, training: TrainingSpec, kernels: KernelSpec,
                         num_micro_batches: int) -> dict[str, float]:
    """Memory materialized attention needs outside the layers: the persistent score buffer and the masks."""
    out: dict[str, float] = {}
    b, s = training.micro_batch_size, training.max_seq_len
    if kernels.attention == "materialized":
        heads = dims.num_heads / layout.parallel.tensor_parallel
        out["attention score buffer (megatron global)"] = training.param_bytes * b * heads * s * s
    if kernels.explicit_attention_mask:
        out["attention masks on device (bool)"] = num_micro_batches * b * s * s
    return out


def rollout_kv_bytes_per_token(dims: ModelDims, rollout_tp: int, kv_bytes: int) -> int:
    if dims.mla is not None:
        return dims.num_layers * (dims.mla.kv_lora_rank + dims.mla.qk_rope_head_dim) * kv_bytes
    kv_heads = max(dims.num_kv_heads // rollout_tp, 1)
    return 2 * dims.num_layers * kv_heads * dims.head_dim * kv_bytes


ROLLOUT_HOST_COPY = "rollout weights kept through sleep (pinned, each tensor rounded up to a power of two)"


def pinned_copy_bytes(nbytes: float) -> float:
    """Host memory one page-locked copy of a device tensor takes: CUDA's caching allocator gives a tensor of a
    MiB or more a segment of its own in 2 MiB steps, and PyTorch's pinned host allocator rounds every request up
    to a power of two (torch 2.11 on the GPU box: 2.12x resident growth over what was asked for a mix of sizes,
    ``bench/pinned_host_probe.py``). Smaller tensors share segments: counted as they are."""
    if nbytes < 2**20:
        return nbytes
    segment = math.ceil(nbytes / 2**21) * 2**21
    return float(2 ** math.ceil(math.log2(segment)))


def rollout_weights_host_copy(dims: ModelDims, params: ParamCount, rollout_tp: int, weight_bytes: int) -> float:
    """Host memory of a sleeping rollout engine's copy of its weights (vLLM's sleep level 1 copies each weight
    allocation into a pinned host tensor of its own), per GPU: the large tensors as vLLM lays them out (fused q/k/v
    and gate/up, each MoE layer's experts as two tensors, embedding and head), each rounded by
    :func:`pinned_copy_bytes`; the rest (norms, biases, routers) as it is. MLA attention counts its projections
    as one tensor per layer, a lower bound of its rounding. Measured at 14B served LoRA on one H100: the worker
    held 55.0 GB beyond the merged run's, this gives 52.6 GB (2026-12-08, docs/benchmarks.md)."""
    h = dims.hidden_size
    tensors: list[int] = [params.embedding] + ([params.output_head] if params.output_head else [])
    for layer, counts in enumerate(params.per_layer):
        if dims.mla is None:
            q_width, kv_width = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
            tensors += [h * (q_width + 2 * kv_width), q_width * h]
        else:
            mlp = dims.moe.shared_expert_intermediate_size if dims.is_moe_layer(layer) else dims.intermediate_size
            tensors.append(counts.tp_sharded - 3 * h * mlp)  # tp_sharded holds the dense / shared-expert MLP too
        if dims.is_moe_layer(layer):
            moe = dims.moe
            tensors += [moe.num_experts * 2 * moe.expert_intermediate_size * h,
                        moe.num_experts * moe.expert_intermediate_size * h]
            if moe.shared_expert_intermediate_size:
                tensors += [2 * moe.shared_expert_intermediate_size * h, moe.shared_expert_intermediate_size * h]
        else:
            tensors += [2 * dims.intermediate_size * h, dims.intermediate_size * h]
    shard = weight_bytes / rollout_tp
    large = sum(tensors) * shard
    rest = max(params.total * shard - large, 0.0)
    return sum(pinned_copy_bytes(count * shard) for count in tensors) + rest


def _in_flight_units(layout: LayoutSpec, stage: int, num_micro_batches: int) -> float:
    """Stage-fractions of activations stage ``stage`` holds at its 1F1B peak."""
    pp, v = layout.parallel.pipeline_parallel, layout.parallel.virtual_pipeline_parallel or 1
    if v == 1:
        return min(pp - stage, num_micro_batches)
    chunks = min(2 * (pp - stage - 1) + (v - 1) * pp + 1, num_micro_batches * v)
    return chunks / v


def _stage_activation_bytes(
    dims: ModelDims, layout: LayoutSpec, training: TrainingSpec, layer_kinds: list[bool], stage: int, num_micro: int,
    kernels: KernelSpec,
) -> float:
    tokens = training.micro_batch_size * training.max_seq_len // layout.parallel.context_parallel
    tp = layout.parallel.tensor_parallel
    nd = tp if layout.sequence_parallel and tp > 1 else 1
    a = training.param_bytes
    shape = dict(seq_len=training.max_seq_len, activation_bytes=a, kernels=kernels)
    per_layer = [layer_activation_bytes(dims, layout, tokens, k, layout.recompute, **shape) for k in layer_kinds]
    units = _in_flight_units(layout, stage, num_micro)
    if layout.recompute == "full":
        return _full_recompute_bytes(layout, [layer_activation_bytes(dims, layout, tokens, k, "none", **shape)
                                              for k in layer_kinds], a * tokens * dims.hidden_size / nd, units)
    return units * sum(per_layer)


def _full_recompute_bytes(layout: LayoutSpec, full_layers: list[float], layer_input: float, units: float) -> float:
    """A stage's activations under full recompute, ``full_layers`` its layers' activations kept whole: "uniform"
    keeps each group's input and rebuilds one group at a time in the backward (its working set); "block" keeps
    the input of the first ``recompute_num_layers`` layers of each virtual chunk and everything of the others."""
    if not full_layers:
        return 0.0
    n = layout.recompute_num_layers
    if layout.recompute_method == "block":
        chunks = layout.parallel.virtual_pipeline_parallel or 1
        per_chunk = len(full_layers) // chunks
        recomputed = {i for i in range(len(full_layers)) if per_chunk and i % per_chunk < n}
        kept = sum(b for i, b in enumerate(full_layers) if i not in recomputed)
        working = max((full_layers[i] for i in recomputed), default=0.0)
        return units * (len(recomputed) * layer_input + kept) + working
    groups = [full_layers[i:i + n] for i in range(0, len(full_layers), n)]
    return units * len(groups) * layer_input + max(sum(group) for group in groups)


def plan_layout(
    hf_config: Mapping[str, Any],
    layout: LayoutSpec,
    training: TrainingSpec,
    gpu_memory_gib: float = 80.0,
    *,
    framework_overhead_gib: float = 3.0,
    kernels: KernelSpec = KernelSpec(),
    host_memory_gib: float | None = None,
    host_process_overhead_gib: float = 2.9,
    gpus_per_node: int = 8,
) -> PlanReport:
    """Check ``layout`` against the model in ``hf_config`` and estimate per-GPU memory of every RL phase."""
    dims = read_model_dims(hf_config)
    errors = check_layout(dims, layout, training)
    report = PlanReport(fits=False, errors=errors, warnings=[], gpu_memory_gib=gpu_memory_gib)
    report.params = count_parameters(dims)
    if errors:
        return report

    params = report.params
    gpu_bytes = gpu_memory_gib * GIB
    overhead = framework_overhead_gib * GIB
    stage_layers, _ = split_pipeline_layers(dims.num_layers, layout)
    report.stage_layers = stage_layers
    report.dp, report.expert_dp = layout.dp, layout.expert_dp
    num_micro = training.global_batch_size // (training.micro_batch_size * layout.dp)
    report.num_micro_batches = num_micro
    tp = layout.parallel.tensor_parallel
    vocab_shard = pad_vocab(dims.vocab_size, tp) * dims.hidden_size / tp
    tokens = training.micro_batch_size * training.max_seq_len // layout.parallel.context_parallel
    log_prob_rows = training.log_prob_micro_batch_size or training.micro_batch_size
    log_prob_tokens = log_prob_rows * training.max_seq_len // layout.parallel.context_parallel
    logits_train = logits_bytes(dims, layout, training, kernels=kernels)
    logits_forward = logits_bytes(dims, layout, training, with_grad=False, rows=log_prob_rows, kernels=kernels)
    side = attention_side_bytes(dims, layout, training, kernels, num_micro)
    layer_shape = dict(seq_len=training.max_seq_len, activation_bytes=training.param_bytes, kernels=kernels)
    dense_shards = layout.dp * layout.parallel.context_parallel if layout.distributed_optimizer else 1
    expert_shards = layout.expert_dp if layout.distributed_optimizer else 1

    # Rollout engine, per GPU of one engine.
    rollout_weights = params.total * training.rollout_weight_bytes / layout.rollout_tp
    kv_per_token = rollout_kv_bytes_per_token(dims, layout.rollout_tp, training.kv_cache_bytes)
    rollout_budget = training.rollout_gpu_memory_utilization * gpu_bytes - rollout_weights
    report.rollout_kv_tokens_capacity = max(int(rollout_budget // kv_per_token), 0)
    if report.rollout_kv_tokens_capacity < training.max_seq_len:
        errors.append(
            f"rollout engine: weights need {rollout_weights / GIB:.2f} GiB per GPU at rollout_tp={layout.rollout_tp}, "
            f"leaving {max(rollout_budget, 0) / GIB:.2f} GiB of gpu_memory_utilization="
            f"{training.rollout_gpu_memory_utilization} x {gpu_memory_gib} GiB for KV cache, less than one "
            f"{training.max_seq_len}-token sequence ({training.max_seq_len * kv_per_token / GIB:.2f} GiB): "
            f"raise rollout_tp or gpu memory"
        )
    elif report.rollout_kv_tokens_capacity < training.rollout_max_num_seqs * training.max_seq_len:
        seqs = report.rollout_kv_tokens_capacity // training.max_seq_len
        report.warnings.append(
            f"rollout KV cache holds {report.rollout_kv_tokens_capacity:,} tokens: {seqs} full-length sequences "
            f"at once, not rollout_max_num_seqs={training.rollout_max_num_seqs} (the engine will queue or preempt)"
        )
    rollout_engine = {
        "rollout weights": rollout_weights,
        # vLLM preallocates its whole budget as KV blocks, whatever the batch needs.
        "rollout KV cache (reserved)": max(rollout_budget, 0),
    }

    per_stage_phases: list[list[PhaseMemory]] = []
    host_per_stage: list[dict[str, float]] = []
    first_layer = 0
    for stage, n_layers in enumerate(stage_layers):
        layer_kinds = list(dims.moe_layers[first_layer : first_layer + n_layers])
        layers = params.per_layer[first_layer : first_layer + n_layers]
        first_layer += n_layers
        is_first, is_last = stage == 0, stage == layout.parallel.pipeline_parallel - 1
        dense = expert = 0.0
        for layer in layers:
            d, e = _layer_gpu_params(layer, layout)
            dense += d
            expert += e
        tower = params.vision_tower if is_first else 0  # whole on every TP rank, frozen unless trained
        if is_first:
            dense += vocab_shard + tower
        if is_last:
            dense += params.final_norm
            if not dims.tie_word_embeddings or layout.parallel.pipeline_parallel > 1:
                dense += vocab_shard  # untied head, or the tied embedding's copy on the last stage
        activations = _stage_activation_bytes(dims, layout, training, layer_kinds, stage, num_micro, kernels)
        if is_last:
            activations += logits_train
        if is_last and layout.train_mtp and params.mtp_layer is not None:
            d, e = _layer_gpu_params(params.mtp_layer, layout)
            dense, expert = dense + dims.mtp_layers * d, expert + dims.mtp_layers * e
            activations += dims.mtp_layers * (
                layer_activation_bytes(dims, layout, tokens, params.mtp_layer.is_moe, layout.recompute, **layer_shape)
                + logits_train
            )
        stage_params = dense + expert
        pb, gb = training.param_bytes, training.grad_bytes
        shard_params = dense / dense_shards + expert / expert_shards  # what this GPU's optimizer steps
        trained = stage_params - (0 if training.train_vision_tower else tower)  # what has grads and optimizer state
        if not training.train_vision_tower:
            shard_params -= tower / dense_shards
        if training.lora_rank:  # adapters only (replicated over TP: counted whole, an upper bound)
            trained = n_layers * lora_params_per_layer(dims, training.lora_rank, training.lora_targets)
            shard_params = trained / dense_shards
        host_share = layout.optimizer_offload_fraction if layout.optimizer_cpu_offload else 0.0
        # megatron's HybridDeviceOptimizer keeps fp32 masters + m + v and an fp32 copy of the grads of each of its
        # parameters: on the host (pinned) for its host share, on the device for the rest (the copy is its
        # parameters' .grad, alive from one step to the next)
        per_param = optimizer_bytes_per_param(pb) + (GRAD_BYTES if layout.optimizer_cpu_offload else 0)
        optimizer = per_param * shard_params * (1 - host_share)
        host_optimizer = per_param * shard_params * host_share
        dtype = "bf16" if pb == 2 else "fp32"
        optimizer_name = "optimizer (fp32 master+m+v)" if pb < 4 else "optimizer (fp32 Adam m+v)"
        if layout.optimizer_cpu_offload:
            optimizer_name = f"optimizer on the GPU ({1 - host_share:.0%} of fp32 master+m+v+grads)"
        actor = {
            f"actor params ({dtype})": pb * (stage_params + (trained if training.lora_rank else 0)),
            f"actor main grads ({'fp32' if gb == 4 else 'bf16'})": gb * trained,
            f"actor {optimizer_name}": optimizer,
        }
        params_part, grads_part, optimizer_part = training.offload_parts or (training.offload_train_state,) * 3
        offloaded = dict(zip(actor, (params_part, grads_part, optimizer_part)))
        # with LoRA the reference is the actor's base, its adapters off
        ref = {"reference params": pb * stage_params} if training.use_reference and not training.lora_rank else {}
        critic = {}
        if training.use_critic:
            # Same trunk as the actor; a value head (h -> 1) replaces the output head on the last stage.
            has_head = is_last and (not dims.tie_word_embeddings or layout.parallel.pipeline_parallel > 1)
            critic_params = stage_params - (vocab_shard if has_head else 0) + (dims.hidden_size if is_last else 0)
            # (the critic trains every parameter: the actor's adapters say nothing of it)
            critic_optimizer = per_param * critic_params / dense_shards * (1 - host_share)
            critic = {
                f"critic params ({dtype})": pb * critic_params,
                f"critic main grads ({'fp32' if gb == 4 else 'bf16'})": gb * critic_params,
                f"critic {optimizer_name}": critic_optimizer,
            }
        forward_act = max(layer_activation_bytes(dims, layout, log_prob_tokens, k, "none", **layer_shape)
                          for k in layer_kinds)
        forward_act += logits_forward if is_last else 0
        colocated = layout.placement == "colocated"
        # what stays on the GPU while the rollout engine generates (the actor by part; ref/critic as a whole)
        kept_train = {name: value for name, value in actor.items() if not offloaded[name]}
        if not training.offload_train_state:
            kept_train.update({**ref, **critic})
        kept_rollout = rollout_engine if colocated and not training.rollout_sleeps else {}

        phases = []
        if colocated:
            phases.append(PhaseMemory("rollout", stage, {**rollout_engine, **kept_train, "framework overhead": overhead}))
        # the worker brings every offloaded part of the actor back before its log-prob pass (for_training)
        logprob = {**kept_rollout, **kept_train, **actor, **ref}
        logprob["forward activations (no grad)"] = forward_act
        logprob.update(side)
        logprob["framework overhead"] = overhead
        phases.append(PhaseMemory("log-prob (old + ref)", stage, logprob))
        train = {**kept_rollout, **kept_train, **actor}
        train["actor activations"] = activations - (logits_train if is_last else 0)
        if is_last:
            train["actor logits + log-prob buffers"] = logits_train
        # torch's foreach Adam allocates one fp32 tensor the size of what it steps on the device (v's square
        # root); the step runs once the backward has freed the activations, so the phase holds the larger one
        step_temporary = MASTER_PARAM_BYTES * shard_params * (1 - host_share)
        if step_temporary > activations:
            train["optimizer step's fp32 temporary beyond the activations"] = step_temporary - activations
        train.update(side)
        train["framework overhead"] = overhead
        phases.append(PhaseMemory("actor train", stage, train))
        if training.use_critic:
            critic_train = {**kept_rollout, **kept_train, **critic}
            critic_train["critic activations"] = activations - (logits_train if is_last else 0)
            critic_train.update(side)
            critic_train["framework overhead"] = overhead
            phases.append(PhaseMemory("critic train", stage, critic_train))
        per_stage_phases.append(phases)
        host = {"actor optimizer on the host (fp32 master+m+v + pinned fp32 grads)": host_optimizer}
        if colocated:  # what the rollout phase parks in host memory (grads are dropped, not saved)
            host["actor params parked while generating"] = actor[f"actor params ({dtype})"] * params_part
            host["actor GPU optimizer share parked while generating"] = optimizer * optimizer_part
            if training.offload_train_state:
                host.update({f"{name} parked while generating": value for name, value in {**ref, **critic}.items()
                             if "grads" not in name})
        host_per_stage.append(host)

    for i in range(len(per_stage_phases[0])):
        report.phases.append(max((stage[i] for stage in per_stage_phases), key=lambda p: p.total))
    if layout.placement == "separate":
        report.phases.insert(
            0, PhaseMemory("rollout (rollout GPUs)", 0, {**rollout_engine, "framework overhead": overhead})
        )
    report.peak = max(report.phases, key=lambda p: p.total)
    # host memory of one node: every GPU of the node holds its stage's share (the worst stage, to be safe)
    worst_host = max(host_per_stage, key=lambda h: sum(h.values()))
    gpus_per_node = min(layout.world_size, gpus_per_node)
    report.host = {name: value * gpus_per_node for name, value in worst_host.items() if value}
    report.host["worker processes (libraries, CUDA context, rollout engine)"] = (
        host_process_overhead_gib * GIB * gpus_per_node)
    if layout.placement == "colocated" and training.rollout_keeps_weights_on_host:
        report.host[ROLLOUT_HOST_COPY] = (
            rollout_weights_host_copy(dims, params, layout.rollout_tp, training.rollout_weight_bytes)
            * gpus_per_node)
    if host_memory_gib is not None and report.host_total > host_memory_gib * GIB:
        top = sorted(report.host.items(), key=lambda kv: -kv[1])
        errors.append(
            f"host memory: {report.host_total / GIB:.2f} GiB needed on a node of {gpus_per_node} GPU(s) but it has "
            f"{host_memory_gib:.2f} GiB (" + ", ".join(f"{n} {v / GIB:.2f} GiB" for n, v in top) + "): lower "
            "override_optimizer_config.optimizer_offload_fraction or offload fewer parts"
            + ("; or lora.merge=true (the engine then drops its weights in sleep and gets merged ones at each sync)"
               if ROLLOUT_HOST_COPY in report.host else "")
        )
    for phase in report.phases:
        if phase.total > gpu_bytes:
            top = sorted(phase.components.items(), key=lambda kv: -kv[1])[:3]
            errors.append(
                f"{phase.phase} needs {phase.total / GIB:.2f} GiB on pipeline stage {phase.stage} but the GPU has "
                f"{gpu_memory_gib:.2f} GiB: over by {(phase.total - gpu_bytes) / GIB:.2f} GiB (largest: "
                + ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in top)
                + ")"
            )
    report.fits = not errors
    return report
