"""Benchmark the streaming checkpoint converters against the disk's raw copy bandwidth.

    python bench/convert_bench.py [--hf DIR | --size-gb 1.0] [--tp 2] [--workers 1] [--budget-mb 256] [--work DIR]

Without ``--hf`` a synthetic fp32 Llama-layout checkpoint of about ``--size-gb`` is written first. Then,
on the same disk: (1) raw: copy the checkpoint's safetensors bytes with a buffered 16 MiB read/write loop
and fsync (what any converter must at least do); (2) hf->mcore and (3) mcore->hf, each in a fresh
subprocess that reports its wall time and peak RSS above its post-import baseline. Prints a markdown
table. The page cache is not dropped (that needs root on a shared machine), so reads may be warm for
all three rows alike.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def raw_copy(src_dir: str, dst_dir: str) -> tuple[int, float]:
    os.makedirs(dst_dir, exist_ok=True)
    total, started = 0, time.perf_counter()
    buffer = bytearray(16 * 2**20)
    view = memoryview(buffer)
    for path in sorted(glob.glob(os.path.join(src_dir, "*.safetensors"))):
        with open(path, "rb", buffering=0) as src, open(os.path.join(dst_dir, os.path.basename(path)), "wb") as dst:
            while got := src.readinto(buffer):
                dst.write(view[:got])
                total += got
            dst.flush()
            os.fsync(dst.fileno())
    return total, time.perf_counter() - started


def child(direction: str, src: str, dst: str, tp: int, workers: int, budget: int) -> None:
    import torch

    import megarl.models.bridge  # noqa: F401
    from megarl.models.convert.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.convert.mcore_to_hf import convert_mcore_to_hf
    from megarl.models.convert.memory import current_rss_bytes, peak_rss_bytes

    meta = torch.empty(4, 4, device="meta")  # torch's one-off meta-kernel registration is baseline
    torch.cat([meta, meta]).chunk(2)[0].contiguous()
    baseline = current_rss_bytes()
    started = time.perf_counter()
    if direction == "hf_to_mcore":
        convert_hf_to_mcore(src, dst, tp=tp, workers=workers, memory_budget_bytes=budget, max_file_bytes=budget)
    else:
        convert_mcore_to_hf(src, dst, max_shard_bytes=budget, workers=workers)
    print(json.dumps({"seconds": time.perf_counter() - started, "rss_over_baseline": peak_rss_bytes() - baseline}))


def run_child(*args) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *map(str, args)],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(path, "**", "*.safetensors"), recursive=True))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        d, src, dst, tp, workers, budget = sys.argv[2:8]
        return child(d, src, dst, int(tp), int(workers), int(budget))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", default=None)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--budget-mb", type=int, default=256)
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir, removed)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="convert_bench_")
    budget = args.budget_mb * 2**20
    try:
        hf = args.hf
        if hf is None:
            from megarl.models.convert.synthetic import write_synthetic_llama_checkpoint

            hf = os.path.join(work, "hf")
            layers = max(1, round(args.size_gb * 1e9 / 15.8e6))  # ~15.8 MB per layer at hidden 512 fp32
            write_synthetic_llama_checkpoint(hf, num_layers=layers)
        size = dir_bytes(hf)
        raw_bytes, raw_s = raw_copy(hf, os.path.join(work, "raw"))
        to_mcore = run_child("hf_to_mcore", hf, os.path.join(work, "mc"), args.tp, args.workers, budget)
        to_hf = run_child("mcore_to_hf", os.path.join(work, "mc"), os.path.join(work, "back"), args.tp,
                          args.workers, budget)
        raw_gbs = raw_bytes / raw_s / 1e9
        rows = [("raw buffered copy + fsync", raw_bytes, raw_s, None),
                (f"hf_to_mcore tp={args.tp}", size, to_mcore["seconds"], to_mcore["rss_over_baseline"]),
                ("mcore_to_hf", dir_bytes(os.path.join(work, "back")), to_hf["seconds"], to_hf["rss_over_baseline"])]
        print(f"checkpoint: {size / 1e9:.2f} GB in {len(glob.glob(os.path.join(hf, '*.safetensors')))} files; "
              f"workers={args.workers}; budget={args.budget_mb} MiB\n")
        print("| step | GB | seconds | GB/s | vs raw | peak RSS over baseline |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, nbytes, seconds, rss in rows:
            gbs = nbytes / seconds / 1e9
            rss_text = "-" if rss is None else f"{rss / 2**20:.0f} MiB"
            print(f"| {name} | {nbytes / 1e9:.2f} | {seconds:.1f} | {gbs:.3f} | {gbs / raw_gbs:.2f}x | {rss_text} |")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
