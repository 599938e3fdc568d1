"""A DeepSeek-V3-671B conversion rehearsed on a few layers with the real shapes, and extrapolated.

    python bench/convert_671b_rehearsal.py [--workers 16] [--budget-gb 96] [--work DIR] [--json OUT.json]

Three synthetic checkpoints in DeepSeek-V3's release layout (FP8 e4m3 weights with 128x128 block scales, MLA,
256 routed experts of 2048 + one shared expert, vocabulary 129280, hidden 7168; no MTP layer) are converted to
megatron's torch_dist format, each in a fresh subprocess: B = embeddings + head + 1 dense layer, C = B + a second
dense layer, A = B + 1 MoE layer. Their differences give the time of one dense layer (C - B) and of one MoE layer
(A - B); the whole model (3 dense + 58 MoE layers) is estimated as B + 2 (C - B) + 58 (A - B). The estimate
assumes the layers convert at the same rate in a long run as in these short ones (it leaves out that 61 layers
keep every worker busy for longer, which only helps, and a disk that is slower past its cache, which hurts:
the rates are from the same disk at these sizes). Peak RSS: the largest worker's high-water mark and the
parent's (workers x the largest bound the total). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

VARIANTS = {  # name: (num_hidden_layers, first_k_dense_replace)
    "B: 1 dense": (1, 1),
    "C: 2 dense": (2, 2),
    "A: 1 dense + 1 MoE": (2, 1),
}
FULL_DENSE, FULL_MOE = 3, 58


def child(hf: str, out: str, workers: int, budget: int) -> None:
    import megarl.models.bridge  # noqa: F401  (imports are baseline)
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.checkpoint_io.memory import current_rss_bytes, largest_child_peak_rss_bytes, peak_rss_bytes

    baseline = current_rss_bytes()
    started = time.perf_counter()
    convert_hf_to_mcore(hf, out, workers=workers, memory_budget_bytes=budget, max_file_bytes=2 * 10**9)
    print(json.dumps({"seconds": time.perf_counter() - started, "parent_rss": peak_rss_bytes() - baseline,
                      "worker_peak_rss": largest_child_peak_rss_bytes()}))



def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    from bench.convert_bench import child_env

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--budget-gb", type=float, default=96)
    parser.add_argument("--work", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--config", default=os.path.join(REPO, "megarl", "models", "reference_configs", "deepseek_v3",
                                                         "config.json"), help="a DeepSeek-V3-style config.json")
    args = parser.parse_args()
    from megarl.checkpoint_io.synthetic import deepseek_v3_tensors, write_synthetic_checkpoint

    with open(args.config) as handle:
        base = json.load(handle)
    work = args.work or tempfile.mkdtemp(prefix="rehearsal_671b_")
    results = {}
    try:
        for name, (layers, dense) in VARIANTS.items():
            config = dict(base, num_hidden_layers=layers, first_k_dense_replace=dense, num_nextn_predict_layers=0)
            hf, out = os.path.join(work, "hf"), os.path.join(work, "out")
            started = time.perf_counter()
            size = write_synthetic_checkpoint(hf, config, deepseek_v3_tensors(config))
            written_s = time.perf_counter() - started
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", hf, out, str(args.workers),
                                   str(int(args.budget_gb * 2**30))], capture_output=True, text=True,
                                  env=child_env())
            if proc.returncode:
                raise RuntimeError(proc.stderr[-3000:])
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            out_bytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(out) for f in files)
            results[name] = dict(result, input_bytes=size, output_bytes=out_bytes, synthetic_write_s=written_s)
            print(name, json.dumps(results[name]), flush=True)
            shutil.rmtree(hf)
            shutil.rmtree(out)
        b, c, a = (results[n]["seconds"] for n in VARIANTS)
        dense_layer, moe_layer = c - b, a - b
        estimate = b + (FULL_DENSE - 1) * dense_layer + FULL_MOE * moe_layer
        moe_bytes = results["A: 1 dense + 1 MoE"]["input_bytes"] - results["B: 1 dense"]["input_bytes"]
        print(f"\nworkers={args.workers}, cores={os.cpu_count()}\n")
        print("| checkpoint | input GB (FP8) | output GB (bf16) | seconds | largest worker peak RSS | parent |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, r in results.items():
            print(f"| {name} | {r['input_bytes'] / 1e9:.2f} | {r['output_bytes'] / 1e9:.2f} | {r['seconds']:.1f} | "
                  f"{r['worker_peak_rss'] / 2**30:.2f} GiB | {r['parent_rss'] / 2**30:.2f} GiB |")
        print(f"\none dense layer: {dense_layer:.1f} s; one MoE layer: {moe_layer:.1f} s "
              f"({moe_bytes / 1e9:.1f} GB FP8 in, {moe_bytes / moe_layer / 1e9:.2f} GB/s of input)")
        print(f"whole model (3 dense + 58 MoE): ~{estimate / 60:.1f} min")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"workers": args.workers, "cores": os.cpu_count(), "variants": results,
                           "dense_layer_s": dense_layer, "moe_layer_s": moe_layer, "estimate_s": estimate}, handle,
                          indent=1)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
