"""Reference rollout engine on plain HF transformers + torch: batched sampling with a KV cache.

It is the engine that runs anywhere (CPU CI, debugging) and the ground truth the vLLM engine is tested
against. The decoding loop is our own (not `model.generate`) so that the sampled token's log-prob comes
from exactly the distribution it was drawn from, and so that seeding is explicit: one `torch.Generator`
per `generate` call, consumed in a fixed order, makes a call reproducible for the same inputs.

Batching: prompts are left-padded, each repeated `n` times; rows that finished keep being fed a pad id
and are ignored. A vision-language model (Qwen2.5-VL) takes each prompt's images (``multi_modal_inputs``) in the
prefill, with M-RoPE positions placed as the trainer places them (:mod:`megarl.models.vision_language`); each
generated token then counts on from its row's largest position. The image token is sampled like any other (the
policy is the model's whole distribution, as in vLLM and the trainer) and a sampled one is text, as vLLM embeds it
(:func:`~megarl.models.vision_language.image_slots`). Leaves out: speculative decoding, continuous batching, paged
KV cache, tensor parallelism (use the vLLM engine for throughput).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F

from megarl.engines.rollout.base import (RolloutEngine, RolloutOutput, SamplingConfig, check_prompt_seeds,
                                         validate_prompts)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


_PEFT_NAME = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")


def process_logits(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Turn raw next-token logits [rows, vocab] into the log-probs that are sampled from.

    Temperature first, then top-k, then top-p (the order vLLM applies them); filtered tokens get -inf
    and the rest are renormalized. Greedy decoding returns the plain log-softmax.
    """
    logits = logits.float()
    if sampling.is_greedy:
        return F.log_softmax(logits, dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k != -1 and sampling.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the top token always stays.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return F.log_softmax(logits, dim=-1)


_PER_EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

class HFRolloutEngine(RolloutEngine):
    """`AutoModelForCausalLM` from a local directory, sampled with our own KV-cached loop."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        tokenizer_path: str | None = None,
        attn_implementation: str | None = None,
        load_format: str = "auto",
        return_routed_experts: bool = False,
    ) -> None:
        """`return_routed_experts`: an MoE model's outputs carry the experts its routers chose per token
        (`RolloutOutput.routed_experts`, for routing replay in the trainer)."""
        from transformers import AutoConfig

        from megarl.models.hf_config import auto_model_class, is_vision_language
        from megarl.models.vision_language import ImageTokens

        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"HFRolloutEngine: model_path {model_path!r} is not a directory")
        if isinstance(dtype, str):
            if dtype not in _DTYPES:
                raise ValueError(f"HFRolloutEngine: unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}")
            dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        config = AutoConfig.from_pretrained(model_path)
        model_class = auto_model_class(config)
        if load_format == "dummy":  # random weights, to be replaced by the first weight update (vLLM's meaning)
            self.model = model_class.from_config(config, dtype=dtype, **extra)
        elif load_format == "auto":
            self.model = model_class.from_pretrained(model_path, dtype=dtype, **extra)
        else:
            raise ValueError(f"HFRolloutEngine: load_format {load_format!r}; expected 'auto' or 'dummy'")
        self.model = self.model.to(self.device).eval()
        self.vocab_size = self.model.config.get_text_config().vocab_size
        self.image_tokens = ImageTokens.of_config(config) if is_vision_language(config) else None
        self.eos_token_ids = self._collect_eos_ids()
        self.pad_token_id = self._choose_pad_id()
        self._tokenizer_path = tokenizer_path or model_path
        self._tokenizer = None
        # Both the canonical and the tied alias names map to the same Parameter, so an `lm_head.weight`
        # arriving for a tied model lands in the shared embedding instead of raising "unknown name".
        self._params_by_name = dict(self.model.named_parameters(remove_duplicate=False))
        self._params_by_name.update(_checkpoint_names(self.model))
        self._update_open = False
        self._updated_names: set[str] = set()
        self._asleep = False
        self._adapter_base: dict[str, torch.Tensor] = {}  # weight name -> the base under the served adapter
        self._routing: list[torch.Tensor] | None = None  # per MoE layer: the last forward's chosen experts
        if return_routed_experts:
            self._watch_routers()

    def _watch_routers(self) -> None:
        """Keep what each MoE layer's router chose in the last forward: transformers' MoE gates (Qwen3-MoE,
        DeepSeek-V3) return (logits, weights, expert ids)."""
        gates = [layer.mlp.gate for layer in self.model.model.layers if hasattr(layer.mlp, "experts")]
        if not gates:
            raise ValueError(f"HFRolloutEngine: return_routed_experts needs an MoE model; "
                             f"{type(self.model).__name__} has no routed experts")
        self._routing = [None] * len(gates)

        def keeper(index: int):
            def keep(module, args, output):
                self._routing[index] = output[2]
            return keep

        for index, gate in enumerate(gates):
            gate.register_forward_hook(keeper(index))

    def _routed_this_step(self, rows: int, real: torch.Tensor) -> list[torch.Tensor]:
        """Per row, the expert ids ``[tokens, L_moe, K]`` of the real tokens of the last forward."""
        chosen = torch.stack([ids.reshape(rows, real.shape[1], -1) for ids in self._routing], dim=2)
        return [chosen[row][real[row]].to("cpu", torch.int16) for row in range(rows)]

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(self, prompt_token_ids: list[list[int]], sampling: SamplingConfig,
                 multi_modal_inputs: list[dict | None] | None = None) -> list[RolloutOutput]:
        self._check_ready("generate")
        validate_prompts(prompt_token_ids, self.vocab_size)
        if multi_modal_inputs is not None and len(multi_modal_inputs) != len(prompt_token_ids):
            raise ValueError(f"multi_modal_inputs has {len(multi_modal_inputs)} entries for "
                             f"{len(prompt_token_ids)} prompts")
        if multi_modal_inputs is not None and any(multi_modal_inputs) and self.image_tokens is None:
            raise ValueError(f"prompts with images, but {type(self.model).__name__} is a text-only model")
        if sampling.stop and self._load_tokenizer() is None:
            raise ValueError(f"SamplingConfig.stop={sampling.stop!r} needs a tokenizer; none found at "
                             f"{self._tokenizer_path!r}")
        check_prompt_seeds(prompt_token_ids, sampling)
        rows = [(index, prompt) for index, prompt in enumerate(prompt_token_ids) for _ in range(sampling.n)]
        generator = torch.Generator(device=self.device)
        if sampling.seed is not None:
            generator.manual_seed(sampling.seed)
        else:
            generator.seed()
        row_generators = None  # prompt_seeds: each row its own stream, whatever else the call holds
        if sampling.prompt_seeds:
            row_generators = [torch.Generator(device=self.device).manual_seed(sampling.prompt_seeds[index] + sample)
                              for index in range(len(prompt_token_ids)) for sample in range(sampling.n)]
        stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else self.eos_token_ids)

        input_ids, attention_mask = self._left_pad([prompt for _, prompt in rows])
        num_rows = len(rows)
        responses: list[list[int]] = [[] for _ in range(num_rows)]
        log_probs: list[list[float]] = [[] for _ in range(num_rows)]
        finish: list[str | None] = [None] * num_rows

        past = None
        step_ids = input_ids
        routed: list[list[torch.Tensor]] = [[] for _ in range(num_rows)]
        fed_real = attention_mask.bool()  # which of the tokens fed this step are real (not padding)
        prefill_embeddings, next_position = None, None
        if self.image_tokens is not None:  # M-RoPE: [3, rows, P] for the prompts, then one more per token
            prefill_positions, prefill_embeddings = self._image_prefill(
                input_ids, attention_mask, multi_modal_inputs or [None] * len(prompt_token_ids),
                [index for index, _ in rows])
            next_position = prefill_positions.amax(dim=(0, 2)) + 1
        for step in range(sampling.max_tokens):
            if next_position is None:
                position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            elif step == 0:
                position_ids = prefill_positions
            else:
                position_ids = next_position[None, :, None].expand(3, -1, 1)
                next_position = next_position + 1
            # the prefill of prompts with images goes in as embeddings, the images' in their slots
            tokens = {"inputs_embeds": prefill_embeddings} if step == 0 and prefill_embeddings is not None else {
                "input_ids": step_ids}
            out = self.model(**tokens, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            if self._routing is not None:
                for row, ids in enumerate(self._routed_this_step(num_rows, fed_real)):
                    routed[row].append(ids)
            logits = out.logits[:, -1, :]
            token_log_probs = process_logits(logits, sampling)
            if sampling.is_greedy:
                next_ids = token_log_probs.argmax(dim=-1)
            elif row_generators is not None:
                probs = token_log_probs.exp()
                next_ids = torch.cat([torch.multinomial(probs[row], 1, generator=row_generators[row])
                                      for row in range(num_rows)])
            else:
                next_ids = torch.multinomial(token_log_probs.exp(), 1, generator=generator).squeeze(-1)
            chosen = token_log_probs.gather(-1, next_ids.unsqueeze(-1)).squeeze(-1)
            for row in range(num_rows):
                if finish[row] is not None:
                    continue
                token = int(next_ids[row])
                responses[row].append(token)
                log_probs[row].append(float(chosen[row]))
                if token in stop_ids or (sampling.stop and self._hits_stop_string(responses[row], sampling.stop)):
                    finish[row] = "stop"
            if all(reason is not None for reason in finish):
                break
            # Finished rows are fed the pad id; their outputs are already frozen above.
            feed = torch.tensor([self.pad_token_id if finish[r] is not None else responses[r][-1]
                                 for r in range(num_rows)], device=self.device)
            step_ids = feed.unsqueeze(-1)
            fed_real = torch.tensor([[finish[r] is None] for r in range(num_rows)], device=self.device)
            attention_mask = torch.cat([attention_mask, torch.ones_like(attention_mask[:, :1])], dim=-1)

        # every token but a row's last was fed (and routed): prompt + response[:-1]
        return [
            RolloutOutput(prompt_index=rows[r][0], token_ids=responses[r],
                          log_probs=log_probs[r] if sampling.logprobs else None,
                          finish_reason=finish[r] or "length",
                          routed_experts=torch.cat(routed[r]).numpy() if self._routing is not None else None)
            for r in range(num_rows)
        ]

    def _image_prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_inputs: list[dict | None],
                       prompt_of_row: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """M-RoPE positions ``[3, rows, P]`` of the left-padded prompts, and (when any prompt has images) their
        embeddings with the image features in each row's image slots
        (:func:`~megarl.models.vision_language.image_slots`: an image token a multi-turn prompt holds from an
        earlier turn's sampling stays text, as in the trainer). The tower sees each prompt's images once, however
        many rows (samples) the prompt has."""
        from megarl.data.vision_inputs import grid_tokens
        from megarl.models.vision_language import batch_mrope_position_ids, image_slots

        row_inputs = [prompt_inputs[prompt] for prompt in prompt_of_row]
        grids = [None if inputs is None else inputs["image_grid_thw"] for inputs in row_inputs]
        merge, image_id = self.image_tokens.spatial_merge_size, self.image_tokens.image_token_id
        row_grids = [grid for grid in grids if grid is not None]
        positions = batch_mrope_position_ids(input_ids, attention_mask, torch.cat(row_grids) if row_grids else None,
                                             [0 if grid is None else len(grid) for grid in grids],
                                             image_token_id=image_id, spatial_merge_size=merge)
        with_images = [prompt for prompt, inputs in enumerate(prompt_inputs) if inputs is not None]
        if not with_images:
            return positions, None
        slots = torch.stack([image_slots(ids, grid, image_token_id=image_id, spatial_merge_size=merge)
                             for ids, grid in zip(input_ids.cpu(), grids)]).to(self.device)
        tower = self.model.model.visual
        pixels = torch.cat([prompt_inputs[p]["pixel_values"] for p in with_images]).to(self.device, tower.dtype)
        features = tower(pixels, grid_thw=torch.cat([prompt_inputs[p]["image_grid_thw"] for p in with_images])
                         .to(self.device))
        features = getattr(features, "pooler_output", features)  # merged: one row per image token, prompt by prompt
        tokens = [sum(grid_tokens(grid, merge) for grid in prompt_inputs[p]["image_grid_thw"].tolist())
                  for p in with_images]
        per_prompt = dict(zip(with_images, features.split(tokens)))
        features = torch.cat([per_prompt[prompt] for prompt in prompt_of_row if prompt in per_prompt])  # row order
        if int(slots.sum()) != features.shape[0]:
            raise ValueError(f"{int(slots.sum())} image tokens in the prompts, the vision tower made "
                             f"{features.shape[0]} image embeddings from their image_grid_thw")
        embeddings = self.model.get_input_embeddings()(input_ids)
        return positions, embeddings.masked_scatter(slots.unsqueeze(-1), features.to(embeddings.dtype))

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _hits_stop_string(self, response: list[int], stops: tuple[str, ...]) -> bool:
        text = self._tokenizer.decode(response, skip_special_tokens=True)
        return any(stop in text for stop in stops)

    def _collect_eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.config, self.model.config.get_text_config(),
                       getattr(self.model, "generation_config", None)):
            eos = getattr(source, "eos_token_id", None) if source is not None else None
            if eos is None:
                continue
            ids.update([eos] if isinstance(eos, int) else list(eos))
        return ids

    def _choose_pad_id(self) -> int:
        pad = getattr(self.model.config, "pad_token_id", None)
        if pad is not None:
            return int(pad)
        # Pad positions are masked out, so any valid id works; prefer eos for readability of dumps.
        return min(self.eos_token_ids) if self.eos_token_ids else 0

    def _load_tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
            except (OSError, ValueError):
                return None
        return self._tokenizer

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._asleep:
            raise RuntimeError("HFRolloutEngine.update_weights called while asleep; call wake_up() first")
        self._update_open = True
        for name, tensor in named_tensors:
            param = self._find_weight(name)
            if param is None:
                raise KeyError(f"HFRolloutEngine.update_weights: unknown parameter name {name!r}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"HFRolloutEngine.update_weights: shape mismatch for {name!r}: got "
                                 f"{tuple(tensor.shape)}, model has {tuple(param.shape)}")
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
            self._updated_names.add(name)
            self._adapter_base.pop(name, None)  # a new base weight: a served adapter is applied to it next time

    @torch.no_grad()
    def load_adapter(self, named_tensors, config: dict) -> None:
        """Serve a LoRA adapter: each adapted weight becomes ``base + lora_alpha / r * B @ A`` (fp32 product)
        from the base it had before any adapter; weights the previous adapter touched and this one does not
        go back to their base."""
        self._check_ready("load_adapter")
        scale = float(config["lora_alpha"]) / float(config["r"])
        factors: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in named_tensors:
            match = _PEFT_NAME.match(name)
            if match is None:
                raise KeyError(f"HFRolloutEngine.load_adapter: {name!r} is not a PEFT LoRA tensor name")
            factors.setdefault(f"{match.group(1)}.weight", {})[match.group(2)] = tensor
        for name, base in self._adapter_base.items():
            if name not in factors:
                self._find_weight(name).copy_(base)
        for name, pair in factors.items():
            if set(pair) != {"A", "B"}:
                raise ValueError(f"HFRolloutEngine.load_adapter: {name} has lora_{''.join(pair)} only")
            param = self._find_weight(name)
            if param is None:
                raise KeyError(f"HFRolloutEngine.load_adapter: the model has no weight {name!r}")
            base = self._adapter_base.setdefault(name, param.detach().clone())
            update = pair["B"].to(param.device, torch.float32) @ pair["A"].to(param.device, torch.float32)
            param.copy_((base.float() + scale * update).to(param.dtype))

    def _find_weight(self, name: str):
        """The parameter (or fused-expert view, or weight kept as a buffer) a checkpoint tensor named ``name``
        fills; None when none does."""
        param = self._params_by_name.get(name)
        if param is None and name.endswith("e_score_correction_bias"):
            # DeepSeek-V3's router bias is a buffer that checkpoints hold; looked up by name each time, since
            # moving the model (sleep / wake up) replaces buffers, not parameters
            return self.model.get_buffer(name)
        return self._fused_expert_slice(name) if param is None else param

    def _fused_expert_slice(self, name: str):
        """The view of a fused expert parameter that a per-expert checkpoint tensor fills, or None.

        transformers 5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H] holding
        [gate_e; up_e], ``mlp.experts.down_proj`` [E, H, I]) while checkpoints, and so weight sync, name
        them per expert (``mlp.experts.3.gate_proj.weight``).
        """
        match = _PER_EXPERT_NAME.match(name)
        if match is None:
            return None
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        if proj == "down_proj":
            fused = self._params_by_name.get(f"{prefix}.down_proj")
            return None if fused is None else fused[expert]
        fused = self._params_by_name.get(f"{prefix}.gate_up_proj")
        if fused is None:
            return None
        gate, up = fused[expert].chunk(2, dim=0)
        return gate if proj == "gate_proj" else up

    def finish_weight_update(self) -> None:
        # Copies are in place and there is no prefix cache, so finishing only closes the session.
        if not self._update_open:
            raise RuntimeError("HFRolloutEngine.finish_weight_update called without a preceding update_weights")
        self._update_open = False
        self._updated_names.clear()

    # ------------------------------------------------------------------ memory

    @property
    def supports_sleep(self) -> bool:
        # On CPU the "device" is host RAM: there is nothing to move the weights to.
        return self.device.type != "cpu"

    def sleep(self, *, discard_weights: bool = False) -> None:
        """Move the weights to host memory (CUDA) and drop the CUDA cache; the KV cache is per call anyway.
        The weights are always kept (``discard_weights`` is allowed, not required, to drop them).

        On a CPU device nothing is released (documented no-op); the engine still enters the asleep
        state so that a generate/update during sleep fails the same way on every platform.
        """
        if self._asleep:
            return
        if self.device.type != "cpu":
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake_up(self, *, weights_only: bool = False) -> None:
        if not self._asleep:
            return
        if self.device.type != "cpu":
            self.model.to(self.device)
        self._asleep = False

    def shutdown(self) -> None:
        self.model = None
        self._params_by_name = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _check_ready(self, what: str) -> None:
        if self.model is None:
            raise RuntimeError(f"HFRolloutEngine.{what} called after shutdown()")
        if self._asleep:
            raise RuntimeError(f"HFRolloutEngine.{what} called while asleep; call wake_up() first")
        if self._update_open:
            raise RuntimeError(f"HFRolloutEngine.{what} called during a weight update; "
                               "call finish_weight_update() first")


def _checkpoint_names(model) -> dict[str, torch.nn.Parameter]:
    """The checkpoint's name for each parameter transformers renames in memory (Qwen2.5-VL's
    ``model.language_model.*`` is ``model.*`` on disk, ``model.visual.*`` is ``visual.*``): weight sync sends
    checkpoint names. Tensors transformers fuses in memory (MoE experts) are found by ``_fused_expert_slice``."""
    from megarl.models.hf_config import as_checkpoint_names

    params = dict(model.named_parameters(remove_duplicate=False))
    by_identity = {id(param): param for param in params.values()}
    return {name: by_identity[id(tensor)] for name, tensor in as_checkpoint_names(model, dict(params)).items()
            if id(tensor) in by_identity and name not in params}
