"""Does SGLang generate on this GPU, and can it do what a colocated RL rollout needs? (issue 41)

Run on the GPU box after installing the SGLang stage (``STAGE=sglang bash bench/stage_device.sh`` on a CPU
machine; the chunks' ``vllm_install.sh CALL_DIR /tmp/sglang_site`` on the box), with
``PYTHONPATH=/tmp/sglang_site:/tmp/vllm_site:/tmp/site:.``::

    python3 -m bench.sglang_probe /tmp/sglang_probe

A random Qwen2.5-0.5B-shaped model is written (bf16, no tokenizer: token ids in and out, as megarl's engines
talk), then each stage prints one ``RESULT {json}`` line; a failing stage stops only the stages that need it:
import, engine start (SGLang's triton attention and PyTorch sampling: the stage carries no FlashAttention-3 or
flashinfer), generation with log-probs, the same seed twice, an exact weight update from GPU tensors, memory
release and resume, generation after them. Nothing here is megarl's engine: it is the evidence one needs first.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

PROMPTS, PROMPT_LEN, NEW_TOKENS = 8, 64, 32


def result(stage: str, ok: bool, started: float, **fields) -> bool:
    print("RESULT " + json.dumps({"stage": stage, "ok": ok, "seconds": round(time.perf_counter() - started, 2),
                                  **fields}), flush=True)
    return ok


def run_stage(stage: str, fn, *args):
    started = time.perf_counter()
    try:
        value, fields = fn(*args)
    except BaseException as error:  # the stage's failure is the finding: report it, go on
        result(stage, False, started, error=f"{type(error).__name__}: {error}"[:2000],
               traceback=traceback.format_exc()[-3000:])
        return None
    result(stage, True, started, **fields)
    return value


def write_probe_model(root: Path) -> Path:
    import torch

    from bench.e2e_grpo import write_model
    from bench.shapes import model_config

    model = root / "model"
    if not (model / "config.json").is_file():
        write_model(model, model_config("0.5b"), "cuda" if torch.cuda.is_available() else "cpu")
    return model


def import_sglang():
    import sglang

    return sglang, {"version": sglang.__version__}


def start_engine(sglang, model: Path):
    engine = sglang.Engine(model_path=str(model), skip_tokenizer_init=True, attention_backend="triton",
                           sampling_backend="pytorch", mem_fraction_static=0.3, enable_memory_saver=True,
                           disable_cuda_graph=True, random_seed=0, log_level="warning")
    return engine, {}


def prompts(vocab_size: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]


def generate(engine, input_ids, seed=None):
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}
    if seed is not None:
        sampling["sampling_seed"] = seed
    outputs = engine.generate(input_ids=input_ids, sampling_params=sampling, return_logprob=True)
    tokens = [out["output_ids"] for out in outputs]
    logprobs = [[entry[0] for entry in out["meta_info"]["output_token_logprobs"]] for out in outputs]
    if any(len(t) != NEW_TOKENS for t in tokens) or any(len(lp) != NEW_TOKENS for lp in logprobs):
        raise AssertionError(f"lengths {[len(t) for t in tokens]} / {[len(lp) for lp in logprobs]}, "
                             f"{NEW_TOKENS} asked")
    return (tokens, logprobs), {"tokens_per_prompt": NEW_TOKENS, "mean_logprob":
                                sum(map(sum, logprobs)) / (PROMPTS * NEW_TOKENS)}


def same_seed_twice(engine, input_ids):
    (first, _), _ = generate(engine, input_ids, seed=1234)
    (second, _), _ = generate(engine, input_ids, seed=1234)
    (other, _), _ = generate(engine, input_ids, seed=4321)
    return None, {"same_seed_equal": first == second, "other_seed_differs": first != other}


def update_weights(engine):
    import torch

    name = "model.norm.weight"
    before = engine.get_weights_by_name(name, truncate_size=16)
    new = torch.linspace(0.5, 1.5, 896, dtype=torch.bfloat16, device="cuda")
    started = time.perf_counter()
    engine.update_weights_from_tensor(named_tensors=[(name, new)], flush_cache=True)
    seconds = time.perf_counter() - started
    after = engine.get_weights_by_name(name, truncate_size=16)
    if after is None:  # what 0.5.17 answered on the H100 (2026-12-07): the read-back is not there to check against
        return None, {"update_seconds": round(seconds, 4), "read_back": "get_weights_by_name answered None"}
    exact = torch.equal(torch.as_tensor(after, dtype=torch.float32).flatten()[:16], new[:16].float().cpu())
    if not exact:
        raise AssertionError(f"{name} after the update {after} is not the tensor sent {new[:16].tolist()}")
    return None, {"update_seconds": round(seconds, 4), "changed": before != after}


def release_and_resume(engine):
    import torch

    free_before = torch.cuda.mem_get_info()[0]
    engine.release_memory_occupation()
    free_released = torch.cuda.mem_get_info()[0]
    engine.resume_memory_occupation()
    free_resumed = torch.cuda.mem_get_info()[0]
    gib = 2**30
    return None, {"freed_gib": round((free_released - free_before) / gib, 2),
                  "taken_back_gib": round((free_released - free_resumed) / gib, 2)}


def main(argv: list[str]) -> int:
    root = Path(argv[0] if argv else "/tmp/sglang_probe")
    model = run_stage("write_model", lambda: (write_probe_model(root), {}))
    sglang = run_stage("import", import_sglang)
    if model is None or sglang is None:
        return 1
    engine = run_stage("engine_start", start_engine, sglang, model)
    if engine is None:
        return 1
    input_ids = prompts(vocab_size=151936)
    try:
        run_stage("generate", generate, engine, input_ids)
        run_stage("seeds", same_seed_twice, engine, input_ids)
        run_stage("weight_update", update_weights, engine)
        run_stage("release_resume", release_and_resume, engine)
        run_stage("generate_after", generate, engine, input_ids)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
