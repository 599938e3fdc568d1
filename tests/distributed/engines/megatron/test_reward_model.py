"""The Megatron reward model scores what transformers' AutoModelForSequenceClassification scores.

Tiny random Llama, Qwen2 and Qwen3 reward models (fp32, one label) are loaded through the bridge (``score.weight``
into the scalar head) at TP=1 and TP=2, padded and packed, on two real gloo processes. Rows have prompts and
responses of different lengths (left-padded prompts, right-padded responses, one empty response); transformers
scores the same sequences once right-padded and once left-padded, which its last-non-pad-token pooling must
agree on, and megarl's scores must equal both.
"""

import pytest
import torch

from megarl.batch import TrainBatch
from megarl.models.tiny import save_tiny_reward_model
from tests.dist_harness import run_distributed
from tests.distributed.engines.megatron.reward_model_workers import rm_scores_for_layouts

ARCHS = ("llama", "qwen2", "qwen3")
PAD = 0  # the tiny configs' pad_token_id; no real token below uses it
RUNS = [("tp1", dict(), False), ("tp1_packed", dict(), True), ("tp2", dict(tensor_parallel=2), False),
        ("tp2_packed", dict(tensor_parallel=2), True)]


def _batch() -> TrainBatch:
    generator = torch.Generator().manual_seed(5)
    prompt_lens, response_lens, width_p, width_r = [3, 7, 5, 1, 6, 4], [4, 0, 6, 2, 1, 5], 7, 6
    rows = len(prompt_lens)
    prompt_ids = torch.full((rows, width_p), PAD)
    prompt_mask = torch.zeros((rows, width_p), dtype=torch.long)
    response_ids = torch.full((rows, width_r), PAD)
    response_mask = torch.zeros((rows, width_r), dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompt_ids[row, width_p - p:] = torch.randint(1, 250, (p,), generator=generator)
        prompt_mask[row, width_p - p:] = 1
        response_ids[row, :r] = torch.randint(1, 250, (r,), generator=generator)
        response_mask[row, :r] = 1
    return TrainBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                      response_mask=response_mask, group_ids=[str(i) for i in range(rows)])


def _hf_scores(hf_dir: str, batch: TrainBatch, side: str) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    sequences = [ids[mask.bool()] for ids, mask in zip(batch.input_ids, batch.attention_mask)]
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), PAD)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(sequences):
        where = slice(0, len(seq)) if side == "right" else slice(width - len(seq), width)
        ids[row, where], mask[row, where] = seq, 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # left padding: real tokens start at position 0
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits[:, 0]


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    root = tmp_path_factory.mktemp("reward_models")
    hf_dirs = {arch: save_tiny_reward_model(arch, root / arch, seed=3) for arch in ARCHS}
    batch = _batch()
    reference = {(arch, side): _hf_scores(hf_dirs[arch], batch, side) for arch in ARCHS for side in ("right", "left")}
    per_rank = run_distributed(rm_scores_for_layouts, 2, RUNS, hf_dirs, batch, timeout_s=300)
    return reference, per_rank


@pytest.mark.timeout(360)
@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_reward_model_scores_equal_transformers(scored, arch):
    reference, per_rank = scored
    right, left = reference[(arch, "right")], reference[(arch, "left")]
    # fp32 throughout: both sides sum the same products in a different order, so they agree to a few ulps of
    # the activations' scale; the scores themselves are O(1)
    scale = float(right.abs().max())
    assert scale > 0.1 and float(right.std()) > 0.01  # scores that differ between rows, or the test proves nothing
    torch.testing.assert_close(left, right, rtol=0, atol=1e-5 * scale)
    for label, _, _ in RUNS:
        for rank in range(2):
            torch.testing.assert_close(per_rank[rank][(label, arch)], right, rtol=0, atol=1e-5 * scale,
                                       msg=lambda m: f"{label}, rank {rank}: {m}")
