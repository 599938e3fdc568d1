"""Convert a Hugging Face safetensors checkpoint to megatron's format (streaming, memory-bounded, resumable).

    python converters/hf_to_mcore.py --hf <hf_dir> --out <mcore_dir> [--workers 8] [--memory-budget-gb 16]
        [--dtype bfloat16] [--max-file-size 4GB]

Writes megatron-core's dist-checkpointing format (torch_dist), the one Megatron-LM's ``--load`` and
``dist_checkpointing.load`` read: ``<out>/iter_0000000/`` and ``<out>/latest_checkpointed_iteration.txt``;
models at any TP/PP/EP load it (megarl: set ``actor_rollout_ref.actor.megatron.use_dist_checkpointing=true``
and ``dist_checkpointing_path=<out>``). Rerunning the same command after an interruption resumes (finished
parts are kept). Library code: :mod:`megarl.checkpoint_io.hf_to_mcore`.
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
    parser.add_argument("--workers", type=int, default=1, help="parallel worker processes")
    parser.add_argument("--memory-budget-gb", type=float, default=None,
                        help="cap on the conversion's working memory; limits concurrent workers")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="cast floating tensors (default: keep HF dtypes; FP8 becomes bfloat16)")
    parser.add_argument("--max-file-size", default="4GB",
                        help="parts of the checkpoint of about this size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import torch

    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.checkpoint_io.memory import parse_size

    budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * 2**30)
    convert_hf_to_mcore(args.hf, args.out, dtype=getattr(torch, DTYPES[args.dtype]) if args.dtype else None,
                        workers=args.workers, memory_budget_bytes=budget, max_file_bytes=parse_size(args.max_file_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
