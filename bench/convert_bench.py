"""Benchmark the streaming checkpoint converters against copying the same bytes on the same disk.

    python bench/convert_bench.py [--hf DIR | --size-gb 1.0] [--workers 1] [--budget-mb 256]
        [--work DIR] [--json OUT.json] [--steps cp,torch_dist,mcore_to_hf] [--repeat 1]

Without ``--hf`` a synthetic fp32 Llama-layout checkpoint of about ``--size-gb`` is written first. Then, on the
same disk and with the same number of processes (``--workers``): (1) ``cp`` of the safetensors files + sync;
(2) raw: the files' bytes split into ``--workers`` equal spans, each copied by its own process with a 16 MiB
pread/pwrite loop and fsync (what any converter must at least do, as parallel as the converter); (3) hf->mcore
to megatron's torch_dist format; (4) mcore->hf from the torch_dist checkpoint (the per-rank format, measured
until 2026-12-05, is retired). Each conversion runs in a fresh subprocess that reports
its wall time and peak RSS above its post-import baseline. Every step starts after a ``sync`` and a pause
(``--settle-s``); ``--repeat N`` runs the steps N times in turn and reports each one's median. Prints a
markdown table (and JSON with ``--json``). The page cache is not dropped (that needs root), so reads may be
warm for every row alike.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _copy_ranges(ranges: list[tuple[str, str, int, int]]) -> int:
    """Copy byte ranges ``[start, end)`` of source files to the same offsets of their (pre-sized) copies."""
    total = 0
    buffer = bytearray(16 * 2**20)
    view = memoryview(buffer)
    for src_path, dst_path, start, end in ranges:
        src, dst = os.open(src_path, os.O_RDONLY), os.open(dst_path, os.O_WRONLY)
        try:
            offset = start
            while offset < end:
                got = os.preadv(src, [view[:min(len(buffer), end - offset)]], offset)
                if got <= 0:
                    raise IOError(f"{src_path}: short read at {offset}")
                os.pwritev(dst, [view[:got]], offset)
                offset += got
            os.fsync(dst)
        finally:
            os.close(src)
            os.close(dst)
        total += end - start
    return total


def split_ranges(paths: list[str], dst_dir: str, workers: int) -> list[list[tuple[str, str, int, int]]]:
    """The files' bytes dealt to ``workers`` processes as equal contiguous spans (a file may be split), so
    every process copies the same amount whatever the number and sizes of the files."""
    sizes = [os.path.getsize(p) for p in paths]
    share = -(-sum(sizes) // workers)
    spans: list[list[tuple[str, str, int, int]]] = [[] for _ in range(workers)]
    worker, room = 0, share
    for path, size in zip(paths, sizes):
        dst = os.path.join(dst_dir, os.path.basename(path))
        offset = 0
        while offset < size:
            take = min(room, size - offset)
            spans[worker].append((path, dst, offset, offset + take))
            offset += take
            room -= take
            if room == 0 and worker < workers - 1:
                worker, room = worker + 1, share
    return [s for s in spans if s]


def raw_copy(src_dir: str, dst_dir: str, workers: int = 1) -> tuple[int, float]:
    """The safetensors files copied by ``workers`` processes, each an equal share of the bytes, with fsync."""
    from concurrent.futures import ProcessPoolExecutor

    os.makedirs(dst_dir, exist_ok=True)
    paths = sorted(glob.glob(os.path.join(src_dir, "*.safetensors")))
    spans = split_ranges(paths, dst_dir, max(1, workers))
    started = time.perf_counter()
    for path in paths:
        with open(os.path.join(dst_dir, os.path.basename(path)), "wb") as handle:
            handle.truncate(os.path.getsize(path))
    if len(spans) <= 1:
        total = sum(_copy_ranges(s) for s in spans)
    else:
        with ProcessPoolExecutor(len(spans)) as pool:
            total = sum(pool.map(_copy_ranges, spans))
    return total, time.perf_counter() - started


def settle(seconds: float) -> None:
    """Let the disk go quiet: flush every dirty page, then wait for what the flush left running (ext4 mounted
    with ``discard`` trims deleted files' blocks in the background)."""
    subprocess.run(["sync"], check=True)
    time.sleep(seconds)


def cp_copy(src_dir: str, dst_dir: str) -> tuple[int, float]:
    os.makedirs(dst_dir, exist_ok=True)
    paths = sorted(glob.glob(os.path.join(src_dir, "*.safetensors")))
    started = time.perf_counter()
    subprocess.run(["cp", *paths, dst_dir], check=True)
    subprocess.run(["sync"], check=True)
    return sum(os.path.getsize(p) for p in paths), time.perf_counter() - started


STEPS = ("cp", "torch_dist", "mcore_to_hf")  # the raw copy always runs: it is the baseline
CHILD_DIRECTIONS = {"torch_dist": "hf_to_torch_dist", "mcore_to_hf": "mcore_to_hf"}


def child(direction: str, src: str, dst: str, workers: int, budget: int, part: int) -> None:
    import torch

    import megarl.models.bridge  # noqa: F401  (imported before the clock starts)
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.checkpoint_io.mcore_to_hf import convert_mcore_to_hf
    import logging

    from megarl.checkpoint_io.memory import current_rss_bytes, largest_child_peak_rss_bytes, peak_rss_bytes

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the run's timing summary
    meta = torch.empty(4, 4, device="meta")  # torch's one-off meta-kernel registration is baseline
    torch.cat([meta, meta]).chunk(2)[0].contiguous()
    baseline = current_rss_bytes()
    started = time.perf_counter()
    if direction == "hf_to_torch_dist":
        convert_hf_to_mcore(src, dst, workers=workers, memory_budget_bytes=budget, max_file_bytes=part)
    else:
        convert_mcore_to_hf(src, dst, max_shard_bytes=part, workers=workers)
    print(json.dumps({"seconds": time.perf_counter() - started, "rss_over_baseline": peak_rss_bytes() - baseline,
                      "largest_worker_peak_rss": largest_child_peak_rss_bytes()}))


def run_child(*args) -> dict:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *map(str, args)],
                          capture_output=True, text=True, env=child_env())
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["timing"] = [line for line in proc.stderr.splitlines() if "task(s) on" in line or " took " in line]
    return result


def dir_bytes(path: str, pattern: str = "*.safetensors") -> int:
    return sum(os.path.getsize(p) for p in glob.glob(os.path.join(path, "**", pattern), recursive=True))



def child_env() -> dict:
    """This environment with the repository first on PYTHONPATH (what is already there kept)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        d, src, dst, workers, budget, part = sys.argv[2:8]
        return child(d, src, dst, int(workers), int(budget), int(part))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", default=None)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--budget-mb", type=int, default=256, help="the conversions' memory budget")
    parser.add_argument("--part-mb", type=int, default=None,
                        help="torch_dist parts / per-rank files / HF shards of this size (default: the budget)")
    parser.add_argument("--hidden-size", type=int, default=512, help="synthetic model shape (4096 for an 8B-like)")
    parser.add_argument("--intermediate-size", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--work", default=None, help="scratch directory (default: a temp dir, removed)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the steps this many times in turn; each row is the median of its passes")
    parser.add_argument("--settle-s", type=float, default=3.0,
                        help="before each measured step: sync, then wait this long, so that no step pays for the "
                             "writeback or the discards of the one before (on the CI machine a conversion right "
                             "after another ran 1.8x slower than after a pause)")
    parser.add_argument("--steps", default=",".join(STEPS),
                        help=f"which of {','.join(STEPS)} to run (mcore_to_hf needs torch_dist)")
    args = parser.parse_args()
    steps = args.steps.split(",")
    if set(steps) - set(STEPS) or ("mcore_to_hf" in steps and "torch_dist" not in steps):
        parser.error(f"--steps: choose from {','.join(STEPS)}, mcore_to_hf only with torch_dist")
    work = args.work or tempfile.mkdtemp(prefix="convert_bench_")
    budget = args.budget_mb * 2**20
    part = (args.part_mb or args.budget_mb) * 2**20
    try:
        hf = args.hf
        if hf is None:
            from megarl.checkpoint_io.synthetic import write_synthetic_llama_checkpoint

            import torch

            hf = os.path.join(work, "hf")
            h, f, v = args.hidden_size, args.intermediate_size, args.vocab_size
            dtype = getattr(torch, args.dtype)
            width = torch.empty((), dtype=dtype).element_size()
            heads = max(1, h // 128)
            per_layer = (2 * h * h + 2 * h * (h * max(1, heads // 4) // heads) + 3 * h * f + 2 * h) * width
            layers = max(1, round((args.size_gb * 1e9 - 2 * v * h * width) / per_layer))
            write_synthetic_llama_checkpoint(hf, hidden_size=h, intermediate_size=f, vocab_size=v, num_layers=layers,
                                             num_heads=heads, num_kv_heads=max(1, heads // 4), dtype=dtype,
                                             shard_bytes=4 * 10**9 if h >= 2048 else 256 * 2**20)
        size = dir_bytes(hf)
        samples: dict[str, list[tuple[int, float, Optional[int]]]] = {}  # row -> (bytes, seconds, rss) per pass
        runs = {}
        for attempt in range(args.repeat):  # the steps in turn, so that a slow spell of the disk hits them all
            if attempt:
                for dst in ("td", "back"):
                    shutil.rmtree(os.path.join(work, dst), ignore_errors=True)
            if "cp" in steps:
                settle(args.settle_s)
                cp_bytes, cp_s = cp_copy(hf, os.path.join(work, "cp"))
                shutil.rmtree(os.path.join(work, "cp"))
                samples.setdefault("cp + sync", []).append((cp_bytes, cp_s, None))
            settle(args.settle_s)
            raw_bytes, raw_s = raw_copy(hf, os.path.join(work, "raw"), args.workers)  # every ratio's baseline
            shutil.rmtree(os.path.join(work, "raw"))
            raw_name = f"raw copy, {args.workers} process(es) + fsync"
            samples.setdefault(raw_name, []).append((raw_bytes, raw_s, None))
            for step, name, src, dst in (
                    ("torch_dist", "hf_to_mcore torch_dist", hf, "td"),
                    ("mcore_to_hf", "mcore_to_hf from torch_dist", os.path.join(work, "td"), "back")):
                if step in steps:
                    settle(args.settle_s)
                    runs[step] = run_child(CHILD_DIRECTIONS[step], src, os.path.join(work, dst), args.workers,
                                           budget, part)
                    written = size if step != "mcore_to_hf" else dir_bytes(os.path.join(work, dst))
                    samples.setdefault(name, []).append((written, runs[step]["seconds"],
                                                         runs[step]["rss_over_baseline"]))
        rows = [(name, passes[0][0], statistics.median(p[1] for p in passes), [p[1] for p in passes],
                 max((p[2] for p in passes if p[2] is not None), default=None)) for name, passes in samples.items()]
        raw_bytes, raw_s = next((nbytes, seconds) for name, nbytes, seconds, _, _ in rows if name.startswith("raw"))
        raw_gbs = raw_bytes / raw_s / 1e9
        print(f"checkpoint: {size / 1e9:.2f} GB in {len(glob.glob(os.path.join(hf, '*.safetensors')))} files; "
              f"workers={args.workers}; budget={args.budget_mb} MiB; cores={os.cpu_count()}\n")
        print("| step | GB | seconds (median) | every pass | GB/s | vs raw | peak RSS over baseline |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        table = []
        for name, nbytes, seconds, every, rss in rows:
            gbs = nbytes / seconds / 1e9
            rss_text = "-" if rss is None else f"{rss / 2**20:.0f} MiB"  # the converting process (workers=1)
            passes = " / ".join(f"{s:.1f}" for s in every)
            print(f"| {name} | {nbytes / 1e9:.2f} | {seconds:.1f} | {passes} | {gbs:.3f} | {gbs / raw_gbs:.2f}x | "
                  f"{rss_text} |")
            table.append({"step": name, "bytes": nbytes, "seconds": seconds, "every_pass_seconds": every,
                          "gb_per_s": gbs, "vs_raw": gbs / raw_gbs, "rss_over_baseline": rss})
        for step, run in runs.items():
            for line in run["timing"]:
                print(f"{CHILD_DIRECTIONS[step]}: {line}")
        workers_peak = {CHILD_DIRECTIONS[step]: run["largest_worker_peak_rss"] for step, run in runs.items()}
        if args.workers > 1:
            peaks = ", ".join(f"{k} {v / 2**20:.0f}" for k, v in workers_peak.items())
            print(f"\nlargest worker's peak RSS (MiB): {peaks}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"workers": args.workers, "cores": os.cpu_count(), "size_bytes": size, "rows": table,
                           "timing": {CHILD_DIRECTIONS[step]: run["timing"] for step, run in runs.items()},
                           "largest_worker_peak_rss": workers_peak, "args": vars(args)}, handle, indent=1)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
