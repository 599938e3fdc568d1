"""The rollout-engine contract: sampling settings, per-sample outputs, the engine ABC and its factory.

Every rollout backend (HF/torch reference engine, vLLM) implements `RolloutEngine`; the trainer and
weight-sync code only ever talk to this interface. Inputs and outputs are token ids: tokenization,
chat templates and reward scoring live elsewhere.

Weight-update protocol (the same for every engine):

    for bucket in buckets:                 # bounded lists of (hf_name, tensor)
        engine.update_weights(bucket)      # first call of a session opens it
    engine.finish_weight_update()          # required once after the last bucket

`finish_weight_update()` is mandatory: engines may defer work to it (vLLM finalizes its layerwise reload
and drops the prefix cache there) and `generate()` refuses to run while a session is open, so a half-
updated model is never sampled from.

Log-probs convention: `RolloutOutput.log_probs[t]` is the log-probability of the sampled token under the
*processed* distribution that was actually sampled from (logits / temperature, then top-k / top-p
renormalization); for greedy decoding it is the plain log-softmax of the logits.

Leaves out: prompt log-probs, async/streaming generation; images only through the HF engine so far (vLLM's
engine refuses them).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable
from typing import Literal

import numpy as np
import torch

FinishReason = Literal["stop", "length"]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample responses; mirrors the subset of vLLM `SamplingParams` RL needs.

    `top_k=-1` and `top_p=1.0` disable those filters; `temperature=0.0` means greedy decoding.
    `stop` are strings checked on the decoded response (needs a tokenizer); `stop_token_ids` are
    extra stop ids on top of the model's eos ids. A stop string or stop id ends the sample with
    finish_reason "stop" and the token that completed it is kept in `token_ids`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    ignore_eos: bool = False
    # One seed per prompt, instead of `seed`: sample j of prompt i is drawn with prompt_seeds[i] + j, so what
    # a prompt gets does not depend on the other prompts of the call (multi-turn waves vary with tool timing).
    prompt_seeds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Lists are accepted for convenience; store tuples so the config stays hashable and frozen.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "prompt_seeds", tuple(int(s) for s in self.prompt_seeds))
        if self.n < 1:
            raise ValueError(f"SamplingConfig.n must be >= 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"SamplingConfig.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingConfig.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingConfig.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingConfig.max_tokens must be >= 1, got {self.max_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"SamplingConfig.stop must be non-empty strings, got {self.stop!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def greedy(cls, *, max_tokens: int, n: int = 1, logprobs: bool = False, **kwargs) -> "SamplingConfig":
        """Argmax decoding; the usual choice for evaluation and for engine-equivalence tests."""
        return cls(n=n, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens, logprobs=logprobs, **kwargs)


@dataclasses.dataclass
class RolloutOutput:
    """One sampled response. `token_ids` excludes the prompt and includes a generated eos/stop token.

    `routed_experts` (MoE engines asked for it): `[n, L_moe, K]` expert ids the engine's routers chose for
    the tokens at positions `routed_experts_start ... + n` of prompt + response, per MoE layer in order. The
    last token is never routed (nothing computes it), and an engine serving a prompt prefix from its cache
    did not route that prefix (`routed_experts_start` > 0)."""

    prompt_index: int
    token_ids: list[int]
    log_probs: list[float] | None
    finish_reason: FinishReason
    routed_experts: np.ndarray | None = None
    routed_experts_start: int = 0

    def __post_init__(self) -> None:
        if self.finish_reason not in ("stop", "length"):
            raise ValueError(f"RolloutOutput.finish_reason must be 'stop' or 'length', got {self.finish_reason!r}")
        if self.log_probs is not None and len(self.log_probs) != len(self.token_ids):
            raise ValueError(
                f"RolloutOutput.log_probs has {len(self.log_probs)} entries for {len(self.token_ids)} tokens"
            )
        if self.routed_experts is not None and (self.routed_experts.ndim != 3 or self.routed_experts_start < 0):
            raise ValueError(f"RolloutOutput.routed_experts must be [tokens, moe_layers, top_k] from a start >= 0, "
                             f"got shape {self.routed_experts.shape} from {self.routed_experts_start}")


class RolloutEngine(abc.ABC):
    """A generator of responses whose weights the trainer overwrites between steps."""

    @abc.abstractmethod
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 multi_modal_inputs: list[dict | None] | None = None) -> list[RolloutOutput]:
        """Return `sampling.n` outputs per prompt, grouped by prompt in input order. ``multi_modal_inputs``
        (a vision-language model's): per prompt None or its images, ``{"pixel_values", "image_grid_thw"}`` as
        :func:`megarl.data.vision_inputs.pixel_inputs` makes them, the prompt's image tokens already expanded."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load one bucket of HF-layout tensors (e.g. `model.layers.0.self_attn.q_proj.weight`)."""

    @abc.abstractmethod
    def finish_weight_update(self) -> None:
        """Close the weight-update session opened by the first `update_weights` call."""

    def load_adapter(self, named_tensors: list[tuple[str, torch.Tensor]], config: dict) -> None:
        """Generate with this LoRA adapter on top of the base weights from now on, replacing the previous one.
        ``named_tensors`` in PEFT's names (``base_model.model.<module>.lora_A.weight``), ``config`` the
        adapter's ``adapter_config.json`` (``r``, ``lora_alpha``, ...)."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    @property
    def supports_sleep(self) -> bool:
        """Whether `sleep()` really releases memory on this platform (callers check before colocating)."""
        return True

    @abc.abstractmethod
    def sleep(self, *, discard_weights: bool = False) -> None:
        """Release weights and KV cache memory on the device (colocated mode). With ``discard_weights`` the
        engine may drop its weights instead of keeping a host copy: the caller loads new ones (a weight
        sync) before the next ``generate``."""

    @abc.abstractmethod
    def wake_up(self, *, weights_only: bool = False) -> None:
        """Restore what `sleep()` released; the weights are those from before sleeping (unless discarded).
        ``weights_only`` brings back the weights' memory alone, to load new weights into before the KV
        cache returns; a later ``wake_up()`` restores the rest."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Free every resource; the engine is unusable afterwards."""


def check_prompt_seeds(prompt_token_ids: list[list[int]], sampling: SamplingConfig) -> None:
    if sampling.prompt_seeds and len(sampling.prompt_seeds) != len(prompt_token_ids):
        raise ValueError(f"SamplingConfig.prompt_seeds has {len(sampling.prompt_seeds)} seeds for "
                         f"{len(prompt_token_ids)} prompts")


def first_sample_seed(sampling: SamplingConfig, prompt_index: int) -> int | None:
    """The seed of sample 0 of prompt ``prompt_index``; sample j takes it + j (vLLM's own rule for the n children
    of a request). The prompt's own seed when ``prompt_seeds`` are given, else the call's seed spaced by n so that
    every sample of the call has a seed of its own; None when unseeded. One rule for the engines that seed per
    request, so a run samples alike on either."""
    if sampling.prompt_seeds:
        return sampling.prompt_seeds[prompt_index]
    return None if sampling.seed is None else sampling.seed + prompt_index * sampling.n


def validate_prompts(prompt_token_ids: list[list[int]], vocab_size: int | None) -> None:
    """Raise a ValueError naming the first bad prompt (empty, non-int or out-of-vocabulary id)."""
    if not isinstance(prompt_token_ids, (list, tuple)):
        raise TypeError(f"prompt_token_ids must be a list of lists of ints, got {type(prompt_token_ids).__name__}")
    for index, prompt in enumerate(prompt_token_ids):
        if len(prompt) == 0:
            raise ValueError(f"prompt_token_ids[{index}] is empty")
        for token in prompt:
            if not isinstance(token, int) or token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ValueError(
                    f"prompt_token_ids[{index}] has invalid token id {token!r} (vocab size {vocab_size})"
                )
