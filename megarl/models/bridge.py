"""ModelBridge: one HF causal-LM config <-> megatron-core GPTModel (config, spec, model, weight names).

``ModelBridge.from_hf_config(cfg_or_dict_or_dir, spec="auto"|"local"|"te", core_attention="sdpa"|"local")``
picks the architecture module (Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V3, Qwen2.5-VL) and then answers:

* building: :meth:`transformer_config` (keyword-only, parallel layout in, ``TransformerConfig`` /
  ``MLATransformerConfig`` out), :meth:`layer_spec`, :meth:`build_model`, :meth:`padded_vocab_size`;
* mapping, in GLOBAL megatron names (layer index global over pipeline stages, expert index global over
  expert-parallel ranks) and FULL tensors (what a TP=1 model holds, vocab padded for TP=1):
  :meth:`iter_global_mcore_names`, :meth:`hf_names_for`, :meth:`hf_to_mcore`, :meth:`mcore_to_hf`;
* sharding: :meth:`tp_partition_dim`, :meth:`shard_tp`, :meth:`merge_tp` (experts: pass the expert-TP
  rank/size), and PP/EP name translation :meth:`global_to_local_name` / :meth:`local_to_global_name`.

HF names are the safetensors checkpoint names (what ``save_pretrained`` writes and vLLM reads: one tensor
per expert, ``model.layers.<i>.mlp.experts.<e>.gate_proj.weight``), not transformers 5's in-memory fused
expert parameters.

Core attention on the local spec: ``"sdpa"`` (the default, CPU and CUDA) is
:class:`megarl.models.sdpa_attention.SDPADotProductAttention` (fused PyTorch kernels, also for MLA);
``"local"`` is megatron's own materialising ``DotProductAttention``. The TE spec keeps TE's attention.

Vocabulary padding: a full tensor is padded to ``padded_vocab_size(1)``; :meth:`shard_tp` pads further
to ``padded_vocab_size(tp_size)`` (zero rows) and :meth:`merge_tp` trims back. With tied embeddings there
is no global ``output_layer.weight``; the last pipeline stage's local copy maps to the embedding.

Reward models: a ``<Arch>ForSequenceClassification`` config with one label (``num_labels=1``) gets the bridge
of ``<Arch>ForCausalLM`` with ``head="score"``: the same decoder, and ``output_layer.weight`` is HF's
``score.weight`` (``[1, hidden]``, replicated over TP, never tied) instead of the vocabulary projection. The
engine that uses it swaps the output layer for a scalar head (:mod:`megarl.engines.megatron.reward_model`).

Left out: loading files (:mod:`megarl.models.hf_checkpoint`), MTP layers (skipped, with a log line),
context-parallel specifics (CP does not change parameter layout).
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any, Iterator, Optional, Sequence

import torch

from megarl.models.architectures import Architecture, architecture_for
from megarl.models.architectures.base import build_param_rules
from megarl.models.hf_config import HFConfigLike, architecture_name, load_hf_config
from megarl.models.model_dims import ModelDims
from megarl.models.parallel_layout import ParallelLayout
from megarl.models.vision_language import VISION_PREFIX, vision_tower_of
from megarl.models.weight_mapping import ParamRule, TensorConverter

logger = logging.getLogger(__name__)

SPEC_CHOICES = ("auto", "local", "te")
HEAD_CHOICES = ("lm", "score")  # the vocabulary projection (lm_head) or a reward model's scalar score
SCORE_HEAD_HF_NAME = "score.weight"
_CLASSIFIER_SUFFIX = "ForSequenceClassification"
CORE_ATTENTION_CHOICES = ("sdpa", "local")
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQ_EXPERT_RE = re.compile(r"^(mlp\.experts\.local_experts\.)(\d+)(\..*)$")
_GROUPED_EXPERT_RE = re.compile(r"^(mlp\.experts\.linear_fc[12]\.weight)(\d+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_FIRST_STAGE_PREFIXES = ("embedding.", VISION_PREFIX)  # where the tokens (and images) come in


def transformer_engine_available() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # TE import failures are many and varied (missing libs, CUDA mismatch)
        return False
    return True


def unwrap_model(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's wrappers (DistributedDataParallel, Float16Module keep it at ``.module``)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


class ModelBridge:
    def __init__(self, hf_config: Any, architecture: Architecture, *, spec: str, expert_layout: str,
                 make_vocab_size_divisible_by: int = 128, core_attention: str = "sdpa", head: str = "lm"):
        if core_attention not in CORE_ATTENTION_CHOICES:
            raise ValueError(f"core_attention must be one of {CORE_ATTENTION_CHOICES}, got {core_attention!r}")
        if head not in HEAD_CHOICES:
            raise ValueError(f"head must be one of {HEAD_CHOICES}, got {head!r}")
        self.hf_config = hf_config
        self.architecture = architecture
        self.spec = spec
        self.core_attention = core_attention
        self.expert_layout = expert_layout
        self.make_vocab_size_divisible_by = make_vocab_size_divisible_by
        self.head = head
        self.dims: ModelDims = architecture.read_dims(hf_config)
        if head == "score":  # a classifier has no vocabulary projection to tie to the embedding
            self.dims = dataclasses.replace(self.dims, tie_word_embeddings=False)
        rules = build_param_rules(self.dims, spec=spec, expert_layout=expert_layout)
        rules += architecture.extra_param_rules(self.dims)
        if head == "score":
            rules = [ParamRule("output_layer.weight", (SCORE_HEAD_HF_NAME,)) if rule.mcore_name == "output_layer.weight"
                     else rule for rule in rules]
        self._rules: dict[str, ParamRule] = {rule.mcore_name: rule for rule in rules}
        self.tensors = TensorConverter(self._rules, self.dims.vocab_size, make_vocab_size_divisible_by)
        self._hf_to_mcore_name = {hf: rule.mcore_name for rule in self._rules.values() for hf in rule.hf_names}
        mtp = self.dims.mtp_layers
        if mtp:
            logger.info("%s: skipping %d multi-token-prediction layer(s) (model.layers.%d+); they are not built "
                        "and their HF tensors are ignored", architecture.hf_architecture, mtp, self.dims.num_layers)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_config(cls, hf_config: HFConfigLike, *, spec: str = "auto", expert_layout: Optional[str] = None,
                       make_vocab_size_divisible_by: int = 128, core_attention: str = "sdpa") -> "ModelBridge":
        """``expert_layout``: 'grouped' (TEGroupedMLP; default with TE) or 'sequential' (SequentialMLP).

        ``core_attention`` ('sdpa' or 'local') picks the local spec's core attention; ignored with TE.
        """
        if spec not in SPEC_CHOICES:
            raise ValueError(f"spec must be one of {SPEC_CHOICES}, got {spec!r}")
        if make_vocab_size_divisible_by < 1:
            raise ValueError(f"make_vocab_size_divisible_by must be >= 1, got {make_vocab_size_divisible_by}")
        config = load_hf_config(hf_config)
        resolved = spec if spec != "auto" else ("te" if transformer_engine_available() else "local")
        layout = expert_layout or ("grouped" if resolved == "te" else "sequential")
        name, head = architecture_name(config), "lm"
        if name.endswith(_CLASSIFIER_SUFFIX):
            num_labels = getattr(config, "num_labels", None)
            if num_labels != 1:
                raise ValueError(f"{name} with num_labels={num_labels}: a reward model scores with one label "
                                 f"(num_labels=1)")
            name, head = name[: -len(_CLASSIFIER_SUFFIX)] + "ForCausalLM", "score"
        return cls(config, architecture_for(name), spec=resolved, expert_layout=layout,
                   make_vocab_size_divisible_by=make_vocab_size_divisible_by, core_attention=core_attention,
                   head=head)

    @property
    def hf_architecture(self) -> str:
        name = self.architecture.hf_architecture
        return name[: -len("ForCausalLM")] + _CLASSIFIER_SUFFIX if self.head == "score" else name

    @property
    def tied_embeddings(self) -> bool:
        return self.dims.tie_word_embeddings

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        return self.tensors.padded_vocab_size(tp_size)

    def transformer_config(self, *, layout: ParallelLayout, params_dtype: torch.dtype = torch.float32,
                           fused_kernels: Optional[bool] = None, **overrides: Any):
        """A megatron TransformerConfig (MLATransformerConfig for MLA models) for ``layout``.

        ``fused_kernels`` (default: when CUDA is available) turns on megatron's fused SwiGLU and
        bias-dropout-add, which need neither TE nor apex (megatron compiles them with torch.compile): on an
        H200 they made the packed 1.5B actor update 1.19-1.26x faster and cut its peak memory by 17%
        (docs/benchmarks.md). RoPE and masked-softmax fusion need TE/apex and stay off.
        ``overrides`` win over everything derived here (e.g. ``recompute_granularity``, ``moe_aux_loss_coeff``).
        """
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        kwargs = self.architecture.transformer_config_kwargs(self.hf_config)
        on_cpu = not torch.cuda.is_available()
        fused = not on_cpu if fused_kernels is None else fused_kernels
        kwargs.update(
            tensor_model_parallel_size=layout.tensor_parallel, pipeline_model_parallel_size=layout.pipeline_parallel,
            virtual_pipeline_model_parallel_size=layout.virtual_pipeline_parallel,
            context_parallel_size=layout.context_parallel, expert_model_parallel_size=layout.expert_parallel,
            expert_tensor_parallel_size=layout.expert_tensor_parallel,
            sequence_parallel=False, params_dtype=params_dtype, pipeline_dtype=params_dtype,
            bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
            hidden_dropout=0.0, attention_dropout=0.0, attention_softmax_in_fp32=True,
            bias_activation_fusion=fused, masked_softmax_fusion=False, bias_dropout_fusion=fused,
            apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
            use_cpu_initialization=on_cpu, moe_grouped_gemm=self.expert_layout == "grouped",
        )
        if not self.architecture.has_moe:
            for key in ("moe_grouped_gemm",):
                kwargs.pop(key)
        if layout.virtual_pipeline_parallel is None:
            kwargs.pop("virtual_pipeline_model_parallel_size")
        if layout.first_stage_layers is not None:
            kwargs["num_layers_in_first_pipeline_stage"] = layout.first_stage_layers
        if layout.last_stage_layers is not None:
            kwargs["num_layers_in_last_pipeline_stage"] = layout.last_stage_layers
        kwargs.update(overrides)
        config_cls = MLATransformerConfig if self.architecture.uses_mla else TransformerConfig
        return config_cls(**kwargs)

    def layer_spec(self, config, *, vp_stage: Optional[int] = None):
        """The layer spec (uniform dense models) or decoder block spec (MoE / mixed dense+MoE)."""
        from megatron.core.models.gpt import gpt_layer_specs as specs

        use_te = self.spec == "te"
        if not self.architecture.has_moe and not self.architecture.uses_mla:
            if use_te:
                return specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.dims.qk_norm)
            layer = specs.get_gpt_layer_local_spec(qk_layernorm=self.dims.qk_norm, normalization="RMSNorm")
            if self.core_attention == "sdpa":
                self._use_sdpa_core_attention([layer])
            return layer
        block = specs.get_gpt_decoder_block_spec(config, use_transformer_engine=use_te, normalization="RMSNorm",
                                                 vp_stage=vp_stage)
        if not use_te and self.core_attention == "sdpa":
            self._use_sdpa_core_attention(block.layer_specs)
        elif self.architecture.uses_mla and not use_te:
            from megarl.models.mla_local import patch_mla_core_attention

            patch_mla_core_attention(block.layer_specs)
        return block

    @staticmethod
    def _use_sdpa_core_attention(layer_specs) -> None:
        """Swap megatron's local DotProductAttention for the SDPA one in each layer spec (in place)."""
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        from megarl.models.sdpa_attention import SDPADotProductAttention

        for layer_spec in layer_specs:
            submodules = layer_spec.submodules.self_attention.submodules
            if submodules.core_attention is SDPADotProductAttention:
                continue  # layer specs of one block can share their attention submodules
            if submodules.core_attention is not DotProductAttention:
                raise TypeError(f"expected megatron's local DotProductAttention in the layer spec, found "
                                f"{submodules.core_attention!r}")
            submodules.core_attention = SDPADotProductAttention

    def build_model(self, *, config, pre_process: bool, post_process: bool, vp_stage: Optional[int] = None,
                    tie_embeddings: Optional[bool] = None, train_vision_tower: bool = False):
        """``tie_embeddings=False`` builds a separate output layer even for a tied HF model (the critic
        replaces it with its value head). ``train_vision_tower``: a vision-language model's tower (built frozen)
        trains with the rest; nothing for a text model."""
        from megarl.models import packed_rope
        from megarl.models.fused_norm import fuse_rms_norms

        packed_rope.use()
        kwargs = self.architecture.gpt_model_kwargs(self.hf_config)
        if vp_stage is not None:
            kwargs["vp_stage"] = vp_stage
        model = self.architecture.build_model(
            self.hf_config, params_dtype=config.params_dtype,
            config=config, transformer_layer_spec=self.layer_spec(config, vp_stage=vp_stage),
            vocab_size=self.padded_vocab_size(config.tensor_model_parallel_size),
            pre_process=pre_process, post_process=post_process,
            share_embeddings_and_output_weights=self.tied_embeddings if tie_embeddings is None else tie_embeddings,
            **kwargs,
        )
        if self.spec == "local":  # the local spec's norms are PyTorch's unfused RMSNorm (TE fuses its own)
            fuse_rms_norms(model)
        tower = vision_tower_of(model)
        if train_vision_tower and tower is not None:
            tower.requires_grad_(True)
        return model

    # ------------------------------------------------------------------ names
    def iter_global_mcore_names(self) -> Iterator[str]:
        """Every parameter (and the router ``expert_bias`` buffer) of the whole model, in model order."""
        return iter(self._rules)

    def rule(self, global_name: str) -> ParamRule:
        try:
            return self._rules[global_name]
        except KeyError:
            raise KeyError(f"{global_name!r} is not a parameter of this {self.hf_architecture} bridge "
                           f"(spec={self.spec}, expert_layout={self.expert_layout})") from None

    def hf_names_for(self, global_name: str) -> list[str]:
        return list(self.rule(global_name).hf_names)

    def mcore_name_for_hf(self, hf_name: str) -> Optional[str]:
        """The global megatron name an HF tensor feeds, or None for tensors the bridge skips (MTP)."""
        if hf_name in self._hf_to_mcore_name:
            return self._hf_to_mcore_name[hf_name]
        if self.is_skipped_hf_name(hf_name):
            return None
        raise KeyError(f"unexpected HF tensor {hf_name!r} for {self.hf_architecture}")

    def is_skipped_hf_name(self, hf_name: str) -> bool:
        match = _HF_LAYER_RE.match(hf_name)
        return bool(match) and int(match.group(1)) >= self.dims.num_layers and bool(
            getattr(self.hf_config, "num_nextn_predict_layers", 0))

    def iter_hf_names(self) -> Iterator[str]:
        """The HF tensors the bridge needs (lm_head.weight of a tied model is not needed)."""
        for rule in self._rules.values():
            yield from rule.hf_names

    def is_expert_param(self, global_name: str) -> bool:
        return self.rule(global_name).is_expert

    # ------------------------------------------------------------------ tensors
    def hf_to_mcore(self, global_name: str, hf_tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.tensors.hf_to_mcore(global_name, hf_tensors)

    def mcore_to_hf(self, global_name: str, full_tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return self.tensors.mcore_to_hf(global_name, full_tensor)

    def full_shape(self, global_name: str, hf_shapes: Optional[dict[str, Sequence[int]]] = None) -> tuple[int, ...]:
        """The full (TP=1) shape, computed from HF tensor shapes via meta tensors."""
        rule = self.rule(global_name)
        if hf_shapes is None:
            raise ValueError("full_shape needs the HF tensor shapes")
        metas = {n: torch.empty(tuple(hf_shapes[n]), device="meta") for n in rule.hf_names}
        return tuple(self.hf_to_mcore(global_name, metas).shape)

    def tp_partition_dim(self, global_name: str) -> Optional[int]:
        return self.rule(global_name).tp_partition_dim

    def shard_tp(self, global_name: str, full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
        return self.tensors.shard_tp(global_name, full, tp_rank, tp_size)

    def merge_tp(self, global_name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.tensors.merge_tp(global_name, shards)

    # ------------------------------------------------------------------ PP / EP names
    def global_to_local_name(self, global_name: str, *, layer_offset: int, num_layers_this_stage: int,
                             ep_rank: int = 0, num_local_experts: Optional[int] = None,
                             pre_process: Optional[bool] = None, post_process: Optional[bool] = None) -> Optional[str]:
        """The name this rank's model chunk uses, or None when the chunk does not hold the parameter.

        Layers outside ``[layer_offset, layer_offset + num_layers_this_stage)`` and experts of other EP
        ranks give None; so do the embedding without ``pre_process`` and the final norm / output layer
        without ``post_process`` (when those flags are given).
        """
        self.rule(global_name)
        match = _LAYER_RE.match(global_name)
        if not match:
            on_first_stage = global_name.startswith(_FIRST_STAGE_PREFIXES)
            if on_first_stage and pre_process is False:
                return None
            if not on_first_stage and post_process is False:
                return None
            return global_name
        layer, rest = int(match.group(1)), match.group(2)
        if not layer_offset <= layer < layer_offset + num_layers_this_stage:
            return None
        local_rest = self._expert_to_local(rest, ep_rank, num_local_experts)
        if local_rest is None:
            return None
        return f"decoder.layers.{layer - layer_offset}.{local_rest}"

    def local_to_global_name(self, local_name: str, *, layer_offset: int, ep_rank: int = 0,
                             num_local_experts: Optional[int] = None) -> str:
        if self.tied_embeddings and local_name == "output_layer.weight":
            # The last stage's copy of the tied embedding (megatron keeps it in sync).
            return "embedding.word_embeddings.weight"
        match = _LAYER_RE.match(local_name)
        if not match:
            return self.rule(local_name).mcore_name
        layer, rest = int(match.group(1)) + layer_offset, match.group(2)
        for pattern in (_SEQ_EXPERT_RE, _GROUPED_EXPERT_RE):
            em = pattern.match(rest)
            if em:
                local_expert = int(em.group(2))
                per_rank = self._num_local_experts(num_local_experts)
                if local_expert >= per_rank:
                    raise ValueError(f"{local_name}: local expert {local_expert} >= {per_rank} experts per EP rank")
                rest = f"{em.group(1)}{ep_rank * per_rank + local_expert}{em.group(3) if em.lastindex >= 3 else ''}"
                break
        global_name = f"decoder.layers.{layer}.{rest}"
        self.rule(global_name)
        return global_name

    def _num_local_experts(self, num_local_experts: Optional[int]) -> int:
        per_rank = self.dims.num_experts if num_local_experts is None else num_local_experts
        if per_rank <= 0:
            raise ValueError("num_local_experts must be positive for an MoE parameter")
        return per_rank

    def _expert_to_local(self, rest: str, ep_rank: int, num_local_experts: Optional[int]) -> Optional[str]:
        for pattern in (_SEQ_EXPERT_RE, _GROUPED_EXPERT_RE):
            em = pattern.match(rest)
            if em:
                per_rank = self._num_local_experts(num_local_experts)
                global_expert = int(em.group(2))
                if global_expert // per_rank != ep_rank:
                    return None
                return f"{em.group(1)}{global_expert % per_rank}{em.group(3) if em.lastindex >= 3 else ''}"
        return rest
