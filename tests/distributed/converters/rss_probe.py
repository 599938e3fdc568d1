"""Run one conversion in this (fresh) process and print its resident-memory numbers as JSON.

``python -m tests.distributed.converters.rss_probe hf_to_mcore <hf> <out> <tp> <budget_bytes>`` or
``... mcore_to_hf <mcore> <out> <max_shard_bytes>``. The baseline is taken after every import and a
warm-up conversion of nothing, so that what remains is the conversion's own working memory.
"""

import json
import sys

from megarl.checkpoint_io.memory import current_rss_bytes, peak_rss_bytes


def main() -> None:
    import megarl.models.bridge  # noqa: F401  (import cost is baseline, not conversion memory)
    import transformers  # noqa: F401
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.checkpoint_io.mcore_to_hf import convert_mcore_to_hf

    import torch

    # torch registers its meta kernels on the first meta-tensor op (~150 MB, once per process); the
    # planner uses meta tensors, so that fixed cost belongs to the baseline too.
    meta = torch.empty(4, 4, device="meta")
    torch.cat([meta, meta.new_zeros(2, 4)]).reshape(2, 12).chunk(2)[0].contiguous()
    direction = sys.argv[1]
    baseline = current_rss_bytes()
    if direction == "hf_to_mcore":
        hf, out, budget = sys.argv[2], sys.argv[3], int(sys.argv[4])
        convert_hf_to_mcore(hf, out, memory_budget_bytes=budget, max_file_bytes=budget)
    else:
        convert_mcore_to_hf(sys.argv[2], sys.argv[3], max_shard_bytes=int(sys.argv[4]))
    print(json.dumps({"baseline": baseline, "peak": peak_rss_bytes()}))


if __name__ == "__main__":
    main()
