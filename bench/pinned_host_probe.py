"""How much host memory page-locked copies take on this machine's torch: PyTorch's pinned allocator rounds each
block up to a power of two (megatron's HybridDeviceOptimizer pins its CPU share per parameter, so its host
figure may be up to twice the planner's 16 B/param), and newer torch reads ``pinned_max_round_threshold_mb`` /
``pinned_max_cached_size_mb`` from PYTORCH_CUDA_ALLOC_CONF to skip that for large blocks. Each setting runs in
a child process (the allocator reads its configuration once) that pins 16 blocks of 33 MiB + 4 KiB and reports
its resident growth; megarl's own offload (one registered buffer, megarl/engines/megatron/offload.py) beside.

    python -m bench.pinned_host_probe [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

BLOCKS, BLOCK_BYTES = 16, 33 * 2**20 + 4096
SETTINGS = {
    "default": "",
    "no rounding above 32 MiB": "pinned_max_round_threshold_mb:32,pinned_max_cached_size_mb:32",
}


def child(mode: str) -> dict:
    import torch

    from megarl.checkpoint_io.memory import current_rss_bytes

    torch.cuda.init()
    before = current_rss_bytes()
    if mode == "registered":
        from megarl.engines.megatron.offload import PinnedHostBuffer

        kept = PinnedHostBuffer(BLOCKS * BLOCK_BYTES)
        kept.tensor.zero_()
    else:
        kept = [torch.empty(BLOCK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(BLOCKS)]
        for block in kept:
            block.zero_()
    return {"torch": torch.__version__, "asked_bytes": BLOCKS * BLOCK_BYTES,
            "resident_growth": current_rss_bytes() - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    results = {}
    for name, conf in [*SETTINGS.items(), ("megarl offload buffer", None)]:
        env = dict(os.environ)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        mode = "registered" if conf is None else "allocator"
        run = subprocess.run([sys.executable, "-m", "bench.pinned_host_probe", "--child", mode], env=env,
                             capture_output=True, text=True, timeout=300)
        if run.returncode:
            results[name] = {"error": run.stderr.strip().splitlines()[-1:] or [f"rc {run.returncode}"]}
        else:
            results[name] = json.loads(run.stdout.strip().splitlines()[-1])
            results[name]["growth_over_asked"] = results[name]["resident_growth"] / results[name]["asked_bytes"]
        print(f"{name}: {results[name]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
