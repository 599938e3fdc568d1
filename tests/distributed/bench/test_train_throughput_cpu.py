"""bench/train_throughput.py on CPU: the FLOP count for variable lengths, the rollout-shaped batch, HF's
packed layout against its padded one, and the whole script end to end with a tiny model."""

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.shapes import matmul_params, qwen2_config, train_flops_for_lengths, train_flops_per_token
from bench.train_throughput import (
    hf_packed_micro_batches, hf_padded_micro_batches, hf_response_log_probs, make_grpo_batch, row_lengths,
)
from tests.paths import REPO


@pytest.mark.parametrize("name", ["tiny", "0.5b", "1.5b"])
@pytest.mark.parametrize("seq", [1, 96, 4096])
def test_flops_for_equal_lengths_equal_the_per_token_formula(name, seq):
    cfg = qwen2_config(name)
    rows = 8
    assert train_flops_for_lengths(cfg, [seq] * rows) == pytest.approx(
        train_flops_per_token(cfg, seq) * rows * seq, rel=1e-12)


def test_flops_for_lengths_count_each_sequence_on_its_own():
    cfg = qwen2_config("0.5b")
    lengths = [4096, 1000, 17]
    per_row = sum(train_flops_per_token(cfg, n) * n for n in lengths)
    assert train_flops_for_lengths(cfg, torch.tensor(lengths)) == pytest.approx(per_row, rel=1e-12)
    # Packing three rows into one stream must not be counted as one long causal sequence.
    assert train_flops_for_lengths(cfg, lengths) < train_flops_for_lengths(cfg, [sum(lengths)])
    assert train_flops_for_lengths(cfg, []) == 0.0


def test_a_frozen_base_drops_the_weight_gradients_and_keeps_attentions_backward():
    cfg = qwen2_config("0.5b")
    lengths = [4096, 1000, 17]
    matmuls = 2 * matmul_params(cfg) * sum(lengths)
    attention = train_flops_for_lengths(cfg, lengths) - 3 * matmuls  # all of it attention's forward and backward
    assert attention > 0
    assert train_flops_for_lengths(cfg, lengths, frozen_weights=True) == pytest.approx(2 * matmuls + attention,
                                                                                       rel=1e-12)


def test_uniform_batch_is_rollout_shaped_and_seeded():
    kwargs = dict(rows=64, prompt_len=40, response_len=80, vocab=1000, group_size=8, seed=5, length_dist="uniform")
    batch = make_grpo_batch(**kwargs)
    prompt_real = batch.prompt_mask.sum(1)
    response_real = batch.response_mask.sum(1)
    assert int(prompt_real.min()) >= 20 and int(prompt_real.max()) <= 40
    assert int(response_real.min()) >= 10 and int(response_real.max()) <= 80
    assert len(set(response_real.tolist())) > 10  # actually spread, not one length
    for row in range(len(batch)):  # prompts left-padded, responses right-padded, pad id where masked
        p, r = int(prompt_real[row]), int(response_real[row])
        assert batch.prompt_mask[row].tolist() == [0] * (40 - p) + [1] * p
        assert batch.response_mask[row].tolist() == [1] * r + [0] * (80 - r)
        assert not batch.prompt_ids[row, : 40 - p].any() and not batch.response_ids[row, r:].any()
    assert row_lengths(batch) == (prompt_real + response_real).tolist()
    again = make_grpo_batch(**kwargs)
    assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.attention_mask, batch.attention_mask)
    full = make_grpo_batch(**{**kwargs, "length_dist": "full"})
    assert bool(full.attention_mask.all())
    mbs = hf_padded_micro_batches(full, 4, "cpu")  # nothing to trim, nothing to mask: HF's plain causal call
    assert all(mb["attention_mask"] is None and mb["input_ids"].shape == (4, 120) for mb in mbs)


def _tiny_hf_model(attn_implementation):
    import transformers

    from megarl.models.hf_config import load_hf_config

    torch.manual_seed(0)
    cfg = qwen2_config("tiny", torch_dtype="float32")
    model = transformers.AutoModelForCausalLM.from_config(load_hf_config(cfg), dtype=torch.float32,
                                                          attn_implementation=attn_implementation)
    return model.eval(), cfg


def _log_probs(model, micro_batches):
    # Same dtype as the model: no autocast, so the layouts are compared exactly in fp32.
    off = torch.autocast("cpu", enabled=False)
    with torch.no_grad():
        return [(mb, hf_response_log_probs(model, mb, off)) for mb in micro_batches]


def _scatter(batch, results, rows_of):
    out = torch.zeros(batch.response_ids.shape)
    for (mb, log_probs), rows in zip(results, rows_of):
        out[rows, : log_probs.shape[1]] = log_probs
    return out * batch.response_mask


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_hf_packed_log_probs_equal_padded_and_one_row_at_a_time(attn_implementation):
    from megarl.engines.megatron.packing import plan_token_budget

    model, cfg = _tiny_hf_model(attn_implementation)
    batch = make_grpo_batch(rows=8, prompt_len=24, response_len=40, vocab=cfg["vocab_size"], group_size=4,
                            seed=1, length_dist="uniform")
    batch.old_log_probs = torch.zeros(batch.response_ids.shape)
    mask = batch.response_mask.bool()

    # Ground truth: each row alone, real tokens only, no mask, default positions.
    truth = torch.zeros(batch.response_ids.shape)
    with torch.no_grad():
        for row in range(len(batch)):
            ids = batch.input_ids[row][batch.attention_mask[row].bool()][None]
            p = int(batch.prompt_mask[row].sum())
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0, p - 1:-1], -1)
            r = int(batch.response_mask[row].sum())
            truth[row, :r] = logp.gather(-1, batch.response_ids[row, :r, None])[:, 0]

    padded = _scatter(batch, _log_probs(model, hf_padded_micro_batches(batch, 4, "cpu")), [range(0, 4), range(4, 8)])
    assert hf_padded_micro_batches(batch, 4, "cpu")[0]["attention_mask"] is not None  # padding is really there
    plan = plan_token_budget(row_lengths(batch), 160)
    assert 1 < len(plan) < len(batch)  # several rows per stream, several streams
    packed = _scatter(batch, _log_probs(model, hf_packed_micro_batches(batch, plan, "cpu")), plan)
    torch.testing.assert_close(padded[mask], truth[mask], rtol=0, atol=2e-5)
    torch.testing.assert_close(packed[mask], truth[mask], rtol=0, atol=2e-5)
    assert not packed[~mask].any()

    # Control: the same streams with positions running on across rows are one long causal sequence to HF
    # (no block-diagonal mask), so rows see their neighbours: the comparison above can fail.
    leaky = hf_packed_micro_batches(batch, plan, "cpu")
    for mb in leaky:
        mb["position_ids"] = torch.arange(mb["input_ids"].shape[1])[None]
    leaked = _scatter(batch, _log_probs(model, leaky), plan)
    assert (leaked[mask] - truth[mask]).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_script_end_to_end_on_cpu_uniform_padded_packed_and_hf_packed(tmp_path):
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "bench.train_throughput", "--device", "cpu", "--models", "tiny",
           "--prompt-len", "32", "--response-len", "64", "--rows", "8", "--group-size", "4",
           "--response-len-dist", "uniform", "--max-tokens-per-micro-batch", "padded,192,384",
           "--hf-attn", "sdpa", "--hf-micro-batch-size", "1,2", "--hf-packed",
           "--warmup", "1", "--iters", "1", "--out", str(out)]
    # A torch.distributed world left in this process's environment (e.g. by an in-process trainer test) must
    # not leak into the script's own one-rank world.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="2")
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "megatron/this" in proc.stdout  # the console table
    entry = json.loads(out.read_text())["models"]["tiny"]
    lengths = [p + r for p, r in zip(entry["prompt_lengths"], entry["response_lengths"])]
    assert entry["tokens_per_step"] == sum(lengths) < entry["padded_tokens_per_step"] == 8 * 96
    assert entry["train_flops_per_step"] == pytest.approx(train_flops_for_lengths(qwen2_config("tiny"), lengths))

    measured = {
        "megatron": ("padded", 8), "megatron_tok192": ("packed", None), "megatron_tok384": ("packed", None),
        "hf_sdpa": ("padded", 8), "hf_sdpa_mbs2": ("padded", 4),
        "hf_packed_sdpa_tok192": ("packed", None), "hf_packed_sdpa_tok384": ("packed", None),
    }
    for key, (layout, num_mb) in measured.items():
        m = entry[key]
        assert "error" not in m, (key, m)
        stats = m.get("update_policy", m)
        assert m["layout"] == layout, key
        assert m["real_tokens"] == entry["tokens_per_step"], key
        assert stats["tokens_per_s"] > 0 and stats["achieved_tflops"] > 0 and stats["mfu_vs_spec"] > 0, key
        assert stats["tokens_per_s"] == pytest.approx(entry["tokens_per_step"] / stats["median_s"]), key
        assert stats["iters"] == 1, key
        if num_mb is not None:
            assert m["num_micro_batches"] == num_mb, key
        if layout == "packed":
            assert m["padding_fraction"] == 0.0, key
            assert max(m["micro_batch_real_tokens"]) <= m["max_tokens_per_micro_batch"], key
    # padded micro-batches compute padding: megatron's rows are all P + R wide, HF's pairs their longer row
    assert entry["megatron"]["padding_fraction"] == pytest.approx(1 - entry["tokens_per_step"] / (8 * 96))
    assert 0 < entry["hf_sdpa_mbs2"]["padding_fraction"] < entry["megatron"]["padding_fraction"]
    assert entry["hf_sdpa"]["padding_fraction"] == 0.0  # one row per micro-batch: trimming leaves none
    # megatron and HF pack the same plan: the engine's token-budget bins
    for budget in (192, 384):
        assert entry[f"megatron_tok{budget}"]["micro_batch_real_tokens"] == \
            entry[f"hf_packed_sdpa_tok{budget}"]["micro_batch_real_tokens"]
    assert entry["megatron_tok384"]["num_micro_batches"] < entry["megatron_tok192"]["num_micro_batches"]
    m_rate = entry["megatron_tok192"]["update_policy"]["tokens_per_s"]
    assert entry["ratio_megatron_tok192_over_hf_packed_sdpa_tok192"] == pytest.approx(
        m_rate / entry["hf_packed_sdpa_tok192"]["tokens_per_s"])
    assert entry["ratio_megatron_over_hf_sdpa"] > 0 and entry["ratio_megatron_over_megatron_tok384"] > 0
    assert entry["megatron_tok192"]["log_prob_forward"]["tokens_per_s"] > 0
