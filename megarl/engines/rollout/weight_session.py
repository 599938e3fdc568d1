"""What every rollout engine checks of a weight sync before its tensors reach the model: the checkpoint's names
and shapes (read from the safetensors headers, or from the config when no weights are on disk), a tied
embedding's two names, nothing sent twice, and the whole model sent before the session closes.

A session must carry the whole model because engines rebuild fused modules (vLLM's layerwise reload, SGLang's
fused qkv / gate_up loaders) from what they are handed: a module given part of its tensors would be rebuilt from
memory nobody wrote.

An engine serving a block-wise FP8 checkpoint (DeepSeek-V3's format: ``weight`` in float8_e4m3fn beside its
``weight_scale_inv``) gets the trainer's bf16 weights in that format: the session quantizes each weight the
checkpoint stores in FP8 as it is admitted (:func:`megarl.checkpoint_io.fp8.quantize_fp8_blockwise`), on the
device the tensor is on, and the engine reloads both like a checkpoint."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import torch


def fp8_checkpoint_block(config: dict, checkpoint_shapes: dict[str, tuple[int, ...]]) -> Optional[tuple[int, int]]:
    """The scale block of a block-wise FP8 checkpoint (``quantization_config.quant_method=fp8`` with
    ``weight_scale_inv`` tensors), else None. An FP8 checkpoint of per-tensor scales (``weight_scale``) is refused:
    a bf16 sync would reach its FP8 weights unscaled."""
    from megarl.checkpoint_io.fp8 import SCALE_SUFFIX, fp8_block_size

    quantization = config.get("quantization_config") or {}
    if quantization.get("quant_method") != "fp8":
        return None
    if not any(n.endswith(SCALE_SUFFIX) for n in checkpoint_shapes):
        per_tensor = sorted(n for n in checkpoint_shapes if n.endswith(".weight_scale"))
        if per_tensor:
            raise NotImplementedError(
                f"an FP8 checkpoint with per-tensor scales ({per_tensor[0]}, ...): megarl syncs bf16 weights into "
                "block-wise FP8 checkpoints (weight_scale_inv) only; serve the bf16 checkpoint with "
                "actor_rollout_ref.rollout.quantization=fp8 instead")
        return None
    return fp8_block_size(quantization)


def read_checkpoint_shapes(model_path: str, *, weights_on_disk: bool = True) -> dict[str, tuple[int, ...]]:
    """HF tensor names -> shapes from the safetensors headers in `model_path` (no tensor data is read); with
    ``weights_on_disk=False`` (random weights, ``load_format=dummy``) and no safetensors there, the names and
    shapes of the HF model the config describes, built on the meta device (no memory)."""
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files and not weights_on_disk:
        from transformers import AutoConfig

        from megarl.models.hf_config import as_checkpoint_names, auto_model_class

        config = AutoConfig.from_pretrained(model_path)
        if (getattr(config, "quantization_config", None) or {}).get("quant_method") == "fp8":
            raise NotImplementedError(
                f"{model_path}: random weights (load_format=dummy) for a config that names an FP8 checkpoint "
                "(quantization_config): the FP8 tensors' names come from the checkpoint itself. Drop "
                "quantization_config from config.json for a bf16 rollout, with "
                "actor_rollout_ref.rollout.quantization=fp8 for an FP8 one")
        with torch.device("meta"):
            model = auto_model_class(config).from_config(config)
        state = as_checkpoint_names(model, model.state_dict())  # the sync sends the checkpoint's names
        return {name: tuple(param.shape) for name, param in state.items()
                if not (name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False))}
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model dir {model_path!r}")
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


class WeightUpdateSession:
    """The names one weight update has delivered, checked against the checkpoint as buckets arrive.

    Trainers export a tied model's head too; engines' loaders ignore ``lm_head.weight`` for tied models, so it
    is taken as the embedding's alias (whichever of the two comes first is loaded, the other dropped)."""

    def __init__(self, engine: str, checkpoint_shapes: dict[str, tuple[int, ...]], *, tied: bool,
                 fp8_block: Optional[tuple[int, int]] = None) -> None:
        self.engine = engine  # the engine's class name, for messages
        self.checkpoint_shapes = checkpoint_shapes
        self.fp8_block = fp8_block  # a block-wise FP8 checkpoint's scale block (fp8_checkpoint_block)
        self.tied = tied and "lm_head.weight" not in checkpoint_shapes
        self.open = False
        self.names: set[str] = set()

    def admit(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The bucket as the engine should load it (the tied alias resolved, a second copy of the embedding
        dropped); raises naming the first tensor the checkpoint does not have, of another shape, or sent twice.
        Opens the session."""
        bucket: list[tuple[str, torch.Tensor]] = []
        seen = set(self.names)
        for name, tensor in self._in_checkpoint_format(named_tensors):
            if self.tied and name == "lm_head.weight":
                name = "model.embed_tokens.weight"
                if name in seen:
                    continue  # the alias of an embedding already sent in this session
            elif self.tied and name == "model.embed_tokens.weight" and name in seen:
                continue  # sent earlier under its alias lm_head.weight
            expected = self.checkpoint_shapes.get(name)
            if expected is None:
                raise KeyError(f"{self.engine}.update_weights: unknown parameter name {name!r}")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{self.engine}.update_weights: shape mismatch for {name!r}: got "
                                 f"{tuple(tensor.shape)}, checkpoint has {expected}")
            if name in seen:
                raise ValueError(f"{self.engine}.update_weights: {name!r} sent twice in one weight update")
            seen.add(name)
            bucket.append((name, tensor))
        self.open = True
        return bucket

    def _in_checkpoint_format(self, named_tensors: Iterable[tuple[str, torch.Tensor]]):
        """Each weight the checkpoint stores in block-wise FP8, quantized, followed by its scale; the rest as sent
        (and a weight sent already in FP8 with its scale, as it is)."""
        from megarl.checkpoint_io.fp8 import FP8_DTYPES, SCALE_SUFFIX, quantize_fp8_blockwise

        for name, tensor in named_tensors:
            if self.fp8_block is None or name + SCALE_SUFFIX not in self.checkpoint_shapes or tensor.dtype in FP8_DTYPES:
                yield name, tensor
                continue
            quantized, scale_inv = quantize_fp8_blockwise(tensor, block=self.fp8_block, name=name)
            yield name, quantized
            yield name + SCALE_SUFFIX, scale_inv

    def loaded(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """The engine took this bucket (a bucket it refused stays unsent)."""
        self.names.update(name for name, _ in bucket)

    def check_complete(self) -> None:
        """Refuses (the session stays open) while checkpoint tensors are missing."""
        if not self.open:
            raise RuntimeError(f"{self.engine}.finish_weight_update called without a preceding update_weights")
        missing = sorted(set(self.checkpoint_shapes) - self.names)
        if missing:
            raise RuntimeError(
                f"{self.engine}.finish_weight_update: the session lacks {len(missing)} checkpoint tensors "
                f"(e.g. {missing[:3]}); send them with update_weights and call finish_weight_update again")

    def close(self) -> None:
        self.open = False
        self.names.clear()
