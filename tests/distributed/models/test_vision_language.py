"""Qwen2.5-VL in megatron (megarl/models/vision_language.py) against transformers' own model.

A tiny random Qwen2.5-VL checkpoint (two vision blocks, one windowed, one full; M-RoPE sections 2/3/3) is loaded
through the bridge into megatron at TP=1 and TP=2 on two real gloo processes; a padded batch of two rows with
three images of different grids (one row padded on the right, one on the left, an image first in its row, two
images in one row) goes through it with megarl's M-RoPE positions, and every real token's logits are compared
with transformers' model of the same checkpoint given the processor's inputs (``mm_token_type_ids``), row by row,
unpadded, in fp32. The M-RoPE positions are compared with transformers' ``get_rope_index`` on their own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megarl.models.tiny import (TINY_VL_IMAGE_TOKEN_ID, TINY_VL_VISION_END_ID, TINY_VL_VISION_START_ID,
                                save_tiny_vl_checkpoint)
from tests.dist_harness import run_distributed

IMAGE = TINY_VL_IMAGE_TOKEN_ID
PATCH_VALUES = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch
MERGE = 2
# (frames, rows, columns) of patches per image; tokens per image = product / MERGE**2
GRIDS = [(1, 4, 6), (1, 2, 2), (1, 4, 4)]
PAD = 0


def image_run(grid) -> list[int]:
    return [TINY_VL_VISION_START_ID] + [IMAGE] * (grid[0] * grid[1] * grid[2] // MERGE ** 2) + [TINY_VL_VISION_END_ID]


# row 0: text, image 0, text (padded on the right); row 1: image 1 first, text, image 2, text (padded on the left)
ROWS = [[5, 6, 7] + image_run(GRIDS[0]) + [8, 9, 10, 11],
        image_run(GRIDS[1]) + [12, 13] + image_run(GRIDS[2]) + [14]]
IMAGES_PER_ROW = [1, 2]


def padded_batch():
    width = max(len(r) for r in ROWS)
    input_ids = torch.full((len(ROWS), width), PAD)
    mask = torch.zeros(len(ROWS), width, dtype=torch.long)
    input_ids[0, :len(ROWS[0])], mask[0, :len(ROWS[0])] = torch.tensor(ROWS[0]), 1
    input_ids[1, width - len(ROWS[1]):], mask[1, width - len(ROWS[1]):] = torch.tensor(ROWS[1]), 1
    generator = torch.Generator().manual_seed(0)
    pixel_values = torch.randn(sum(t * h * w for t, h, w in GRIDS), PATCH_VALUES, generator=generator)
    return input_ids, mask, pixel_values, torch.tensor(GRIDS)


def patches_of(image: int, pixel_values: torch.Tensor) -> torch.Tensor:
    starts = [0]
    for t, h, w in GRIDS:
        starts.append(starts[-1] + t * h * w)
    return pixel_values[starts[image]:starts[image + 1]]


def transformers_logits(hf_dir: str) -> list[torch.Tensor]:
    """transformers' logits of each row alone, unpadded, with the inputs its processor would give."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    _, _, pixel_values, grids = padded_batch()
    first_image, out = 0, []
    for row, count in zip(ROWS, IMAGES_PER_ROW):
        ids = torch.tensor([row])
        images = list(range(first_image, first_image + count))
        first_image += count
        with torch.no_grad():
            out.append(model(input_ids=ids, mm_token_type_ids=(ids == IMAGE).int(),
                             pixel_values=torch.cat([patches_of(i, pixel_values) for i in images]),
                             image_grid_thw=grids[images]).logits[0])
    return out


def megatron_logits(rank: int, hf_dir: str, torch_dist_dir: str | None = None) -> dict:
    """Logits at TP=1 and TP=2 of the model loaded from ``hf_dir`` by megarl's HF loader, and at TP=2 from
    ``torch_dist_dir`` (its conversion) by plain megatron-core, if given."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import load_hf_weights
    from megarl.models.vision_language import batch_mrope_position_ids

    input_ids, mask, pixel_values, grids = padded_batch()
    positions = batch_mrope_position_ids(input_ids, mask, grids, IMAGES_PER_ROW, image_token_id=IMAGE,
                                         spatial_merge_size=MERGE)
    width = input_ids.shape[1]
    # megatron's mask: True where attention is not allowed (the future, and padding keys)
    attention_mask = (torch.triu(torch.ones(width, width, dtype=torch.bool), diagonal=1)[None, None]
                      | (mask == 0)[:, None, None, :])
    results = {}
    runs = [("tp1", 1), ("tp2", 2)] + ([("tp2_torch_dist", 2)] if torch_dist_dir else [])
    for label, tp in runs:
        layout = ParallelLayout(tensor_parallel=tp)
        initialize_megatron_parallel(layout=layout, seed=11)
        bridge = ModelBridge.from_hf_config(hf_dir, spec="local")
        config = bridge.transformer_config(layout=layout, perform_initialization=False)
        model = bridge.build_model(config=config, pre_process=True, post_process=True).eval()
        if label.endswith("torch_dist"):
            from megatron.core import dist_checkpointing

            loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, f"{torch_dist_dir}/iter_0000000")
            model.load_state_dict(loaded["model"], strict=True)
        else:
            load_hf_weights([model], hf_dir, bridge)
        with torch.no_grad():
            logits = model(input_ids, positions, attention_mask, pixel_values=pixel_values,
                           image_grid_thw=grids).contiguous()
        if tp > 1:
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits, group=mpu.get_tensor_model_parallel_group())
            logits = torch.cat(parts, dim=-1)
        results[label] = logits[..., :bridge.dims.vocab_size]
        if label == "tp1":
            results["vision_names"] = {n: tuple(p.shape) for n, p in model.named_parameters()
                                       if n.startswith("vision_model.")}
    return results


# the policy may sample the image token: in a response it is text (vLLM and the HF engine embed it so)
RESPONSES = [[20, IMAGE, 22], [23, 24, IMAGE, IMAGE, 27]]


def rollout_batch():
    """The two rows as prompts (left-padded, as the rollout leaves them) with text responses (right-padded)."""
    from megarl.batch import TrainBatch

    _, _, pixel_values, grids = padded_batch()
    prompt_width, response_width = max(map(len, ROWS)), max(map(len, RESPONSES))
    prompt_ids, prompt_mask = torch.zeros(2, prompt_width, dtype=torch.long), torch.zeros(2, prompt_width)
    response_ids, response_mask = torch.zeros(2, response_width, dtype=torch.long), torch.zeros(2, response_width)
    inputs, first_image = [], 0
    for i, (prompt, response, count) in enumerate(zip(ROWS, RESPONSES, IMAGES_PER_ROW)):
        prompt_ids[i, prompt_width - len(prompt):], prompt_mask[i, prompt_width - len(prompt):] = torch.tensor(prompt), 1
        response_ids[i, :len(response)], response_mask[i, :len(response)] = torch.tensor(response), 1
        images = list(range(first_image, first_image + count))
        first_image += count
        inputs.append({"pixel_values": torch.cat([patches_of(j, pixel_values) for j in images]),
                       "image_grid_thw": grids[images]})
    return TrainBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask.long(), response_ids=response_ids,
                      response_mask=response_mask.long(), group_ids=["a", "b"], multi_modal_inputs=inputs)


def transformers_model(hf_dir: str):
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()


@torch.no_grad()
def transformers_inputs(model, prompt: list[int], response: list[int], images: dict):
    """transformers' input embeddings and M-RoPE positions of one row with its images: the image features go into
    the prompt's image tokens only (a response's image tokens, sampled by the policy, are embedded as text),
    positions are transformers' own ``get_rope_index`` of the prompt, counting on by one after it."""
    ids = torch.tensor([prompt + response])
    prompt_ids = ids[:, :len(prompt)]
    embeddings = model.get_input_embeddings()(ids)
    features = model.model.visual(images["pixel_values"], grid_thw=images["image_grid_thw"])
    embeddings[0, :len(prompt)][prompt_ids[0] == IMAGE] = getattr(features, "pooler_output", features)
    prompt_positions, _ = model.model.get_rope_index(
        prompt_ids, image_grid_thw=images["image_grid_thw"], mm_token_type_ids=(prompt_ids == IMAGE).int(),
        attention_mask=torch.ones_like(prompt_ids))
    after = prompt_positions.max() + 1 + torch.arange(len(response))
    return embeddings, torch.cat([prompt_positions, after.expand(3, 1, -1)], dim=-1)


def scored_by_transformers(model, prompt: list[int], response: list[int], images: dict) -> torch.Tensor:
    """log p(response token | everything before it) of one row with its images, by transformers."""
    embeddings, positions = transformers_inputs(model, prompt, response, images)
    with torch.no_grad():
        logits = model(inputs_embeds=embeddings, position_ids=positions).logits[0]
    predicting = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return predicting.gather(1, torch.tensor(response)[:, None])[:, 0]


def final_hidden_by_transformers(model, prompt: list[int], response: list[int], images: dict) -> torch.Tensor:
    """transformers' last hidden states (after the final norm) at the positions predicting each response token."""
    embeddings, positions = transformers_inputs(model, prompt, response, images)
    with torch.no_grad():
        hidden = model.model(inputs_embeds=embeddings, position_ids=positions).last_hidden_state[0]
    return hidden[len(prompt) - 1:-1]


def transformers_response_log_probs(hf_dir: str) -> list[torch.Tensor]:
    model, batch = transformers_model(hf_dir), rollout_batch()
    return [scored_by_transformers(model, prompt, response, batch.multi_modal_inputs[row])
            for row, (prompt, response) in enumerate(zip(ROWS, RESPONSES))]


def megatron_parts(hf_dir: str, tp: int, pp: int = 1, **build_kwargs):
    """Megatron's parallel state for TP x PP, the checkpoint's bridge and config, and a model provider building
    it with ``build_kwargs``."""
    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.models.bridge import ModelBridge

    layout = ParallelLayout(tensor_parallel=tp, pipeline_parallel=pp)
    initialize_megatron_parallel(layout=layout, seed=11)
    bridge = ModelBridge.from_hf_config(hf_dir, spec="local")
    config = bridge.transformer_config(layout=layout, perform_initialization=False)

    def provide(pre_process, post_process, vp_stage=None):
        return bridge.build_model(config=config, pre_process=pre_process, post_process=post_process, **build_kwargs)

    return bridge, config, provide


def engine_log_probs(rank: int, hf_dir: str) -> dict:
    from megarl.engines.megatron.actor import ReferenceEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.models.hf_checkpoint import load_hf_weights

    results = {}
    for label, tp, pp, packing in (("tp1_padded", 1, 1, False), ("tp1_packed", 1, 1, True),
                                   ("tp2_packed", 2, 1, True), ("pp2_padded", 1, 2, False)):
        bridge, config, provide = megatron_parts(hf_dir, tp, pp)
        engine = ReferenceEngine(model_provider=provide, config=config, micro_batch_size=2,
                                 vocab_size=bridge.dims.vocab_size,
                                 micro_batching=MicroBatching(sequence_packing=packing))
        load_hf_weights(engine.model, hf_dir, bridge)
        results[label] = engine.compute_log_probs(rollout_batch())[0]
    return results


def critic_values(rank: int, hf_dir: str) -> dict:
    """A critic of the vision-language model (value head on the loaded trunk, as the critic worker builds it):
    its values of the image batch, padded at TP=1 and packed at TP=2, and its head's weight and bias."""
    from megarl.engines.megatron.critic import CriticEngine
    from megarl.engines.megatron.micro_batches import MicroBatching
    from megarl.models.hf_checkpoint import load_hf_weights

    results = {}
    for label, tp, packing in (("tp1_padded", 1, False), ("tp2_packed", 2, True)):
        bridge, config, provide = megatron_parts(hf_dir, tp, tie_embeddings=False)
        engine = CriticEngine(model_provider=provide, config=config, optimizer_config=None, micro_batch_size=2,
                              micro_batching=MicroBatching(sequence_packing=packing))
        load_hf_weights(engine.model, hf_dir, bridge, exclude_prefixes=("output_layer.",))
        results[label] = engine.compute_values(rollout_batch())
        head = [m for m in engine.model[0].modules() if type(m).__name__ == "ValueHead"][0]
        results["head"] = (head.weight.detach().clone(), head.bias.detach().clone())
    return results


def synced_logits(rank: int, hf_dir: str):
    """Megatron at TP=2 with every weight moved (the vision tower's too), synced into an HF rollout engine: the
    trainer's and the engine's logits of the padded image batch, and how many tensors the sync moved."""
    import zlib

    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    from megarl.engines.megatron.parallel import ParallelLayout, initialize_megatron_parallel
    from megarl.engines.rollout.hf_engine import HFRolloutEngine
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import load_hf_weights
    from megarl.models.vision_language import batch_mrope_position_ids
    from megarl.weight_sync import ColocatedTransport, sync_weights

    layout = ParallelLayout(tensor_parallel=2)
    initialize_megatron_parallel(layout=layout, seed=11)
    bridge = ModelBridge.from_hf_config(hf_dir, spec="local")
    model = bridge.build_model(config=bridge.transformer_config(layout=layout), pre_process=True,
                               post_process=True).eval()
    load_hf_weights([model], hf_dir, bridge)
    with torch.no_grad():  # noise seeded by name: a replicated weight moves alike on both TP ranks
        for name, param in model.named_parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode()))))
    engine = HFRolloutEngine(hf_dir)
    stats = sync_weights([model], bridge, ColocatedTransport(engine), bucket_bytes=64 * 1024)
    input_ids, mask, pixel_values, grids = padded_batch()
    positions = batch_mrope_position_ids(input_ids, mask, grids, IMAGES_PER_ROW, image_token_id=IMAGE,
                                         spatial_merge_size=MERGE)
    width = input_ids.shape[1]
    attention = torch.triu(torch.ones(width, width, dtype=torch.bool), 1)[None, None] | (mask == 0)[:, None, None, :]
    with torch.no_grad():
        trainer = model(input_ids, positions, attention, pixel_values=pixel_values, image_grid_thw=grids).contiguous()
        parts = [torch.empty_like(trainer) for _ in range(2)]
        dist.all_gather(parts, trainer, group=mpu.get_tensor_model_parallel_group())
        trainer = torch.cat(parts, dim=-1)[..., :bridge.dims.vocab_size]
        rollout = engine.model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                               pixel_values=pixel_values, image_grid_thw=grids,
                               mm_token_type_ids=(input_ids == IMAGE).int()).logits
    return trainer, rollout, stats.num_tensors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_vl_checkpoint(tmp_path_factory.mktemp("tiny_vl") / "hf", seed=5)


@pytest.mark.timeout(300)
def test_megatron_qwen2_5_vl_gives_transformers_logits_at_tp1_and_tp2(checkpoint):
    reference = transformers_logits(checkpoint)
    per_rank = run_distributed(megatron_logits, 2, checkpoint, timeout_s=240)
    _, mask, _, _ = padded_batch()
    for rank, results in enumerate(per_rank):
        for label in ("tp1", "tp2"):
            for row, want in enumerate(reference):
                got = results[label][row][mask[row].bool()]
                scale = want.abs().max()
                assert scale > 0.1, "degenerate reference logits would prove nothing"
                # fp32 throughout; TP=2 sums its row-parallel partial products in another order
                torch.testing.assert_close(got, want, atol=1e-5 * float(scale), rtol=0,
                                           msg=lambda m: f"rank {rank} {label} row {row}: {m}")


@pytest.mark.timeout(300)
def test_the_bridge_names_every_vision_tensor_and_maps_it_both_ways(checkpoint):
    from megarl.models.bridge import ModelBridge
    from megarl.models.hf_checkpoint import HFCheckpointReader

    bridge = ModelBridge.from_hf_config(checkpoint, spec="local")
    reader = HFCheckpointReader(checkpoint)
    assert set(bridge.iter_hf_names()) == set(reader.names())  # every checkpoint tensor, nothing more
    for name in bridge.iter_global_mcore_names():
        hf = {n: reader.get(n) for n in bridge.hf_names_for(name)}
        back = dict(bridge.mcore_to_hf(name, bridge.hf_to_mcore(name, hf)))
        assert back.keys() == hf.keys() and all(torch.equal(back[n], hf[n]) for n in hf), name
    vision = {n for n in bridge.iter_global_mcore_names() if n.startswith("vision_model.")}
    assert vision and all(bridge.global_to_local_name(n, layer_offset=0, num_layers_this_stage=2,
                                                      pre_process=False) is None for n in vision)
    assert all(bridge.global_to_local_name(n, layer_offset=0, num_layers_this_stage=2, pre_process=True,
                                           post_process=False) == n for n in vision)


@pytest.mark.timeout(300)
def test_the_engine_scores_responses_to_images_like_transformers_padded_packed_tp2_and_pp2(checkpoint):
    reference = transformers_response_log_probs(checkpoint)
    per_rank = run_distributed(engine_log_probs, 2, checkpoint, timeout_s=240)
    for rank, results in enumerate(per_rank):
        for label, log_probs in results.items():
            for row, want in enumerate(reference):
                got = log_probs[row, :len(want)]
                # log-probs of fp32 logits: an error of the logits' size, relative to the log-sum-exp's (~log V)
                torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=0,
                                           msg=lambda m: f"rank {rank} {label} row {row}: {m}")


@pytest.mark.timeout(300)
def test_a_critic_values_the_responses_to_images_from_transformers_hidden_states_padded_and_packed_tp2(checkpoint):
    """The value of each response token is the value head applied to the hidden state that predicts it, the images
    in their prompt's slots: transformers' final hidden states through the critic's own head."""
    model, batch = transformers_model(checkpoint), rollout_batch()
    hidden = [final_hidden_by_transformers(model, prompt, response, batch.multi_modal_inputs[row])
              for row, (prompt, response) in enumerate(zip(ROWS, RESPONSES))]
    for rank, results in enumerate(run_distributed(critic_values, 2, checkpoint, timeout_s=240)):
        weight, bias = results["head"]
        for label in ("tp1_padded", "tp2_packed"):
            for row, h in enumerate(hidden):
                want = (h @ weight.T + bias)[:, 0]
                # fp32 sums over the hidden size: an error of a few ulps of the largest product's size
                scale = float((h.abs() @ weight.abs().T).max())
                torch.testing.assert_close(results[label][row, :len(want)], want, atol=1e-5 * scale, rtol=0,
                                           msg=lambda m: f"rank {rank} {label} row {row}: {m}")


@pytest.mark.timeout(300)
def test_the_hf_rollout_engine_samples_from_the_images_with_the_log_probs_a_whole_forward_gives(checkpoint):
    """The engine's KV-cached decoding (images in the prefill, positions counting on past each row's largest)
    scores each sampled token as transformers' forward of the whole prompt + response does (an image token it
    samples is text)."""
    from megarl.engines.rollout.base import SamplingConfig
    from megarl.engines.rollout.hf_engine import HFRolloutEngine

    engine = HFRolloutEngine(checkpoint)
    inputs = rollout_batch().multi_modal_inputs
    sampling = SamplingConfig(n=2, temperature=1.0, max_tokens=6, logprobs=True, seed=3, ignore_eos=True)
    outputs = engine.generate([list(r) for r in ROWS], sampling, multi_modal_inputs=inputs)
    assert any(IMAGE in output.token_ids for output in outputs)  # seeded: the policy sampled an image token
    model = transformers_model(checkpoint)
    for output in outputs:
        want = scored_by_transformers(model, ROWS[output.prompt_index], output.token_ids, inputs[output.prompt_index])
        torch.testing.assert_close(torch.tensor(output.log_probs), want, atol=1e-5 * float(want.abs().max()), rtol=0)
    # the images reach the samples: other pixels, other log-probs of the same tokens
    blank = [{**row, "pixel_values": torch.zeros_like(row["pixel_values"])} for row in inputs]
    again = engine.generate([list(r) for r in ROWS], sampling, multi_modal_inputs=inputs)
    other = engine.generate([list(r) for r in ROWS], sampling, multi_modal_inputs=blank)
    assert [o.token_ids for o in again] == [o.token_ids for o in outputs]  # seeded: the same samples
    assert any(o.token_ids != b.token_ids or o.log_probs != b.log_probs for o, b in zip(outputs, other))


@pytest.mark.timeout(300)
def test_a_weight_sync_moves_every_part_of_the_model_into_the_rollout_engine(checkpoint):
    from megarl.models.bridge import ModelBridge

    _, mask, _, _ = padded_batch()
    before = transformers_logits(checkpoint)
    tensors = len(list(ModelBridge.from_hf_config(checkpoint, spec="local").iter_hf_names()))
    for rank, (trainer, rollout, moved) in enumerate(run_distributed(synced_logits, 2, checkpoint, timeout_s=240)):
        assert moved == tensors, (moved, tensors)  # the vision tower's tensors among them
        for row in range(len(ROWS)):
            real = mask[row].bool()
            want = trainer[row][real]
            torch.testing.assert_close(rollout[row][real], want, atol=1e-5 * float(want.abs().max()), rtol=0,
                                       msg=lambda m: f"rank {rank} row {row}: {m}")
            assert (rollout[row][real] - before[row]).abs().max() > 1e-2  # the sync changed the engine's model


def tower_and_decoder_moved(rank: int, hf_dir: str) -> dict:
    """One policy update on the image batch with the vision tower built frozen and built trainable: how far the
    tower's and the language model's parameters moved."""
    from megatron.core.optimizer import OptimizerConfig

    from megarl.engines.megatron.actor import ActorEngine
    from megarl.models.bridge import unwrap_model
    from megarl.models.hf_checkpoint import load_hf_weights
    from megarl.models.vision_language import VISION_PREFIX

    moved = {}
    for trainable in (False, True):
        bridge, config, provide = megatron_parts(hf_dir, 2, train_vision_tower=trainable)
        actor = ActorEngine(model_provider=provide, config=config, micro_batch_size=2,
                            optimizer_config=OptimizerConfig(lr=1e-2, clip_grad=0.0),
                            vocab_size=bridge.dims.vocab_size)
        load_hf_weights([unwrap_model(chunk) for chunk in actor.model], hf_dir, bridge)
        actor.optimizer.reload_model_params()
        before = {n: p.detach().clone() for n, p in unwrap_model(actor.model[0]).named_parameters()}
        batch = rollout_batch()
        batch.advantages = torch.tensor([[1.0] * 5, [-1.0] * 5]) * batch.response_mask
        batch.old_log_probs = actor.compute_log_probs(batch)[0]
        actor.update_policy(batch, loss_agg_mode="token-mean", norm_length=batch.response_ids.shape[1])
        after = dict(unwrap_model(actor.model[0]).named_parameters())
        change = {n: float((after[n] - value).abs().max()) for n, value in before.items()}
        moved[trainable] = {part: max(v for n, v in change.items() if n.startswith(VISION_PREFIX) == is_tower)
                            for part, is_tower in (("tower", True), ("decoder", False))}
    return moved


@pytest.mark.timeout(300)
def test_freeze_vision_tower_keeps_the_tower_out_of_the_update_and_false_trains_it(checkpoint):
    for rank, moved in enumerate(run_distributed(tower_and_decoder_moved, 2, checkpoint, timeout_s=240)):
        assert moved[False]["tower"] == 0 and moved[False]["decoder"] > 0, (rank, moved)
        assert moved[True]["tower"] > 0 and moved[True]["decoder"] > 0, (rank, moved)


@pytest.mark.timeout(300)
def test_the_converters_take_the_whole_model_both_ways_and_megatron_loads_it(checkpoint, tmp_path):
    """HF -> torch_dist (the vision tower's tensors beside the decoder's) loads into megatron at TP=2 with plain
    megatron-core and gives transformers' logits; torch_dist -> HF gives back every tensor bit for bit."""
    from safetensors.torch import load_file

    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.checkpoint_io.mcore_to_hf import convert_mcore_to_hf

    convert_hf_to_mcore(checkpoint, tmp_path / "mcore", workers=1)
    convert_mcore_to_hf(tmp_path / "mcore", tmp_path / "back", workers=1)

    def tensors(folder):
        return {name: t for file in sorted(folder.glob("*.safetensors")) for name, t in load_file(file).items()}

    original, back = tensors(Path(checkpoint)), tensors(tmp_path / "back")
    assert sorted(back) == sorted(original) and any(name.startswith("visual.") for name in back)
    assert all(torch.equal(back[name], original[name]) for name in original)
    want = transformers_logits(checkpoint)
    _, mask, _, _ = padded_batch()
    for rank, results in enumerate(run_distributed(megatron_logits, 2, checkpoint, str(tmp_path / "mcore"),
                                                   timeout_s=240)):
        for row, expected in enumerate(want):
            got = results["tp2_torch_dist"][row][mask[row].bool()]
            torch.testing.assert_close(got, expected, atol=1e-5 * float(expected.abs().max()), rtol=0,
                                       msg=lambda m: f"rank {rank} row {row}: {m}")
