"""Asynchronous training (one-step-off, fully async) against synchronous on one workload: separate placement,
real Ray, on CPU.

One rollout worker process (the HF engine) and one training process (the Megatron actor), one core each
(``trainer.n_gpus_per_node=2``, ``trainer.rollout_gpus=1``; the workers run one thread each), the tiny GRPO
recipe with responses of a fixed length (``rollout.ignore_eos=true``) chosen so that generating a batch and
training on it take comparable time. The same command runs ``async_training.mode=sync``, ``one_step_off``
and ``fully_async`` (partial rollouts, staleness 1) back to back and reports, over the steady steps (the first
is left out): step seconds, the stages, tokens/s and the ratios to sync; the synchronous run's
gen / (log-prob + update) says how balanced the stages were. ``--learning`` adds the recipe as it is (short
digit answers, 30 steps) in every mode, for the reward curves.

    python -m bench.async_rollout --out /tmp/async_rollout.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SEPARATE = ["trainer.placement=separate", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1",
            "trainer.progress_bar=false", "trainer.val_before_train=false", "trainer.test_freq=-1",
            "trainer.save_freq=-1", "trainer.logger=[console]"]
STAGES = ("gen", "reward", "old_log_prob", "update_actor", "wait_rollout", "weight_sync", "step")
MODES = ("sync", "one_step_off", "fully_async")


def run_mode(mode: str, overrides: list[str]) -> list[dict]:
    from megarl.run_config import load_config
    from megarl.trainer.main import run

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(REPO / "configs" / "grpo_tiny.yaml",
                          SEPARATE + [f"async_training.mode={mode}", f"trainer.default_local_dir={out}", *overrides])
        return run(cfg)


def steady(history: list[dict]) -> dict[str, float]:
    rows = history[1:]  # the first step starts everything cold (and has no generation to overlap)
    return {stage: statistics.fmean(row.get(f"timing_s/{stage}", 0.0) for row in rows) for stage in STAGES} | {
        "tokens_per_s": statistics.fmean(row["perf/tokens_per_s"] for row in rows)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--response-len", type=int, default=24)
    parser.add_argument("--learning", action="store_true", help="also the recipe's own 30 steps in both modes")
    parser.add_argument("--out")
    parser.add_argument("override", nargs="*", help="extra a.b.c=value overrides of the workload")
    args = parser.parse_args(argv)
    workload = [f"trainer.total_training_steps={args.steps}", f"data.max_response_length={args.response_len}",
                "actor_rollout_ref.rollout.ignore_eos=true", *args.override]
    result: dict = {"workload": workload}
    for mode in MODES:
        result[mode] = steady(run_mode(mode, workload))
    sync = result["sync"]
    for mode in MODES[1:]:
        result[f"speedup_tokens_per_s_{mode}"] = result[mode]["tokens_per_s"] / sync["tokens_per_s"]
    result["sync_gen_over_train"] = sync["gen"] / (sync["old_log_prob"] + sync["update_actor"])
    if args.learning:
        for mode in MODES:
            history = run_mode(mode, ["trainer.total_training_steps=30"])
            result[f"curve_{mode}"] = [round(row["critic/score/mean"], 4) for row in history]
    print("| stage (s, steady mean) | " + " | ".join(MODES) + " |\n| --- |" + " --- |" * len(MODES))
    for key in STAGES + ("tokens_per_s",):
        print(f"| {key} | " + " | ".join(f"{result[mode][key]:.3f}" for mode in MODES) + " |")
    print("tokens/s against sync: " + ", ".join(f"{mode} {result[f'speedup_tokens_per_s_{mode}']:.2f}x"
                                                for mode in MODES[1:])
          + f"; sync gen / (log-prob + update) = {result['sync_gen_over_train']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
