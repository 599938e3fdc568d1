"""Convert a Hugging Face safetensors checkpoint to megatron's format (streaming, memory-bounded, resumable).

    python converters/hf_to_mcore.py --hf <hf_dir> --out <mcore_dir> [--workers 8] [--memory-budget-gb 16]
        [--dtype bfloat16] [--max-file-size 4GB]
    python converters/hf_to_mcore.py --format per_rank --tp 2 --pp 2 --ep 1 --hf <hf_dir> --out <dir>

The default ``--format torch_dist`` writes megatron-core's dist-checkpointing format, the one Megatron-LM's
``--load`` and ``dist_checkpointing.load`` read: ``<out>/iter_0000000/`` and
``<out>/latest_checkpointed_iteration.txt``; models at any TP/PP/EP load it (megarl: set
``actor_rollout_ref.actor.megatron.use_dist_checkpointing=true`` and ``dist_checkpointing_path=<out>``).
``per_rank`` writes megarl's per-rank safetensors, fixed to ``--tp/--pp/--ep``. Rerunning the same command
after an interruption resumes (finished parts are kept). Library code: :mod:`megarl.checkpoint_io.hf_to_mcore`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
          "float32": "float32", "fp32": "float32"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory for the megatron checkpoint")
    parser.add_argument("--format", choices=("torch_dist", "per_rank"), default="torch_dist",
                        help="torch_dist: megatron dist-checkpointing, loads at any layout (default); "
                             "per_rank: megarl's per-rank files for --tp/--pp/--ep")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="parallel worker processes")
    parser.add_argument("--memory-budget-gb", type=float, default=None,
                        help="cap on the conversion's working memory; limits concurrent workers")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="cast floating tensors (default: keep HF dtypes; FP8 becomes bfloat16)")
    parser.add_argument("--spec", choices=("local", "te"), default="local", help="megatron layer spec names")
    parser.add_argument("--max-file-size", default="4GB",
                        help="torch_dist: parts of about this size; per_rank: split a rank's weights into such files")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.checkpoint_io.memory import parse_size

    budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * 2**30)
    convert_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep,
                        dtype=getattr(torch, DTYPES[args.dtype]) if args.dtype else None, spec=args.spec,
                        workers=args.workers, memory_budget_bytes=budget,
                        max_file_bytes=parse_size(args.max_file_size), format=args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
