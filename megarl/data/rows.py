"""The on-disk prompt row: its parquet schema and a writer shared by the synthetic task and the preprocess CLI.

A row is `prompt` (chat messages), `reward_model` ({ground_truth, style}), `data_source` and `extra_info`
(a struct whose fields each writer chooses), and for multimodal prompts `images` (megarl.data.images: a list of
{bytes, path}, one `<image>` in the prompt per image). Reading, validation and tokenization live in `dataset.py`.

Left out: streaming writes of datasets that do not fit in memory (the demo and GSM8K/MATH-size data fit easily).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.checkpoint_io.files import publish, temporary_name
from megarl.data.images import IMAGE_TYPE

MESSAGE_TYPE = pa.struct([("role", pa.string()), ("content", pa.string())])
REWARD_MODEL_TYPE = pa.struct([("ground_truth", pa.string()), ("style", pa.string())])


def make_prompt_row(
    *, messages: Sequence[dict[str, str]], ground_truth: str, data_source: str, extra_info: dict[str, Any],
    style: str = "rule", images: Sequence[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One row in the column layout `RLDataset` reads."""
    row = {
        "prompt": [{"role": m["role"], "content": m["content"]} for m in messages],
        "reward_model": {"ground_truth": ground_truth, "style": style},
        "data_source": data_source,
        "extra_info": dict(extra_info),
    }
    if images is not None:
        row["images"] = list(images)
    return row


def write_prompt_rows(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write rows to a parquet file atomically (temp file + rename); return the path.

    The schema of prompt/reward_model/data_source is fixed so every writer produces the same column types;
    the extra_info struct type is inferred from the rows.
    """
    if not rows:
        raise ValueError(f"refusing to write an empty dataset to {path}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = {
        "prompt": pa.array([r["prompt"] for r in rows], type=pa.list_(MESSAGE_TYPE)),
        "reward_model": pa.array([r["reward_model"] for r in rows], type=REWARD_MODEL_TYPE),
        "data_source": pa.array([r["data_source"] for r in rows], type=pa.string()),
        "extra_info": pa.array([r["extra_info"] for r in rows]),
    }
    if any("images" in r for r in rows):
        columns["images"] = pa.array([r.get("images") or [] for r in rows], type=pa.list_(IMAGE_TYPE))
    table = pa.table(columns)
    tmp = temporary_name(path)  # one per process: concurrent writers of the same file must not clobber each other
    pq.write_table(table, tmp)
    publish(tmp, path)
    return path
