"""What the policy wrote, where a user reads it beside the curves (verl's keys):

* ``trainer.rollout_data_dir``: every training step's rows as ``<dir>/<step>.jsonl``, one line per response:
  ``input`` (the prompt's text), ``output`` (the response's), ``score``, ``step``, ``data_source``, ``gts`` (the
  ground truth) and, for multi-turn conversations, ``agent`` (turns and tool calls, as the reward saw them);
* ``trainer.validation_data_dir``: the same for every validation, named by the step it ran after;
* ``trainer.log_val_generations=N``: N validation samples per validation as a table to every logger that shows
  tables (TensorBoard's text tab, and ``val_generations.jsonl`` beside ``metrics.jsonl``), the same N prompts each
  time (picked by input text and a fixed seed, as verl does), so a reader follows them across steps.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Sequence

import torch

from megarl.batch import RolloutBatch
from megarl.trainer.rollout_assembly import decode_rows


def trace_rows(tokenizer, batch: RolloutBatch, scores: torch.Tensor, step: int) -> list[dict]:
    """One record per row of ``batch`` (its prompt and response decoded)."""
    inputs = decode_rows(tokenizer, batch.prompt_ids, batch.prompt_mask)
    outputs = decode_rows(tokenizer, batch.response_ids, batch.response_mask)
    rows = []
    for index, (text_in, text_out) in enumerate(zip(inputs, outputs)):
        row = {"input": text_in, "output": text_out, "score": float(scores[index]), "step": step,
               "data_source": batch.data_sources[index] if batch.data_sources else None,
               "gts": batch.ground_truths[index] if batch.ground_truths else None}
        extra = batch.extra_infos[index] if batch.extra_infos else None
        if isinstance(extra, dict) and "agent" in extra:
            row["agent"] = extra["agent"]
        rows.append(row)
    return rows


def write_rows(directory: str | Path, step: int, rows: Sequence[dict]) -> Path:
    """``<directory>/<step>.jsonl`` (written whole, then renamed: a reader never sees half a file)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{step}.jsonl"
    partial = path.with_suffix(".jsonl.partial")
    partial.write_text("".join(json.dumps(row, default=str) + "\n" for row in rows))
    partial.replace(path)
    return path


def rows_to_show(rows: Sequence[dict], count: int, seed: int = 42) -> list[dict]:
    """``count`` rows, the same prompts at every validation: sorted by input, shuffled by a fixed seed."""
    ordered = sorted(rows, key=lambda row: (row["input"], row["output"]))
    random.Random(seed).shuffle(ordered)
    return ordered[:count]
