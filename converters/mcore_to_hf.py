"""Convert a megatron checkpoint back to Hugging Face safetensors (streaming).

    python converters/mcore_to_hf.py --mcore <mcore_dir> --out <hf_dir> [--max-shard-size 5GB] [--workers 4]
    python converters/mcore_to_hf.py --mcore <run>/checkpoints/global_step_100/actor --hf-config <hf_model_dir> \
        --out <hf_dir>

``--mcore``: hf_to_mcore.py's output, or a torch_dist checkpoint saved by training (megarl's
``global_step_N/actor``, a Megatron-LM ``--save`` directory or one of its ``iter_*`` directories), saved at any
layout; for those, ``--hf-config`` names the HF model directory whose config.json and tokenizer describe it.
The output loads with ``transformers.AutoModelForCausalLM.from_pretrained``. Rerunning after an interruption
resumes. Library code: :mod:`megarl.checkpoint_io.mcore_to_hf`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mcore", required=True, help="megatron checkpoint directory")
    parser.add_argument("--hf-config", default=None,
                        help="HF model directory describing a checkpoint saved by training (config.json, tokenizer)")
    parser.add_argument("--out", required=True, help="output HF model directory")
    parser.add_argument("--max-shard-size", default="5GB", help="HF shard size bound, e.g. 5GB, 500MB")
    parser.add_argument("--workers", type=int, default=1, help="parallel worker processes")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from megarl.checkpoint_io.memory import parse_size
    from megarl.checkpoint_io.mcore_to_hf import convert_mcore_to_hf

    convert_mcore_to_hf(args.mcore, args.out, max_shard_bytes=parse_size(args.max_shard_size), workers=args.workers,
                        hf_config_dir=args.hf_config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
