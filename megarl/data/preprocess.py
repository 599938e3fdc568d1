"""Convert local JSONL files into the parquet layout `RLDataset` reads.

    python -m megarl.data.preprocess gsm8k --input train.jsonl --output data/gsm8k [--test-input test.jsonl]
    python -m megarl.data.preprocess gsm8k --with-tools --input train.jsonl --output data/gsm8k_tools  (multi-turn)
    python -m megarl.data.preprocess math  --input train.jsonl --output data/math
    python -m megarl.data.preprocess jsonl --input qa.jsonl --output data/qa \
        --prompt-field question --answer-field answer --data-source my/qa
    python -m megarl.data.preprocess geo3k --input geometry3k/train.parquet --output data/geo3k \
        [--test-input geometry3k/test.parquet]

gsm8k rows carry `question` and `answer` ending in `#### N` (ground truth N, thousands commas removed); math rows
carry `problem` and `solution` with a `\\boxed{...}` (ground truth = the last boxed content). Writes
`train.parquet`, and `test.parquet` when `--test-input` is given. A bad row stops the run with file and line.
geo3k reads a local copy of the Hugging Face dataset `hiyouga/geometry3k` as parquet (columns `images`: a list of
{bytes, path}, `problem` with one `<image>` per image, `answer`) and writes verl's multimodal layout
(megarl.data.images), the images carried through as they are.

Left out: downloading datasets (inputs are local files) and answer normalisation beyond what is stated here,
which belongs to the reward scorers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from megarl.data.images import check_one_placeholder_per_image, read_image_entries
from megarl.data.rows import make_prompt_row, write_prompt_rows

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
# gsm8k --with-tools: a system message for multi-turn rollouts with configs/tools/calculator_python.yaml
GSM8K_TOOLS_SYSTEM = ("You are a careful math solver with tools. Reason step by step; use the calculator (or "
                      "python) tool for any arithmetic instead of doing it in your head, read its result, and "
                      "when you are done write the final answer after \"####\".")
GEO3K_INSTRUCTION = ("Reason step by step about the figure, then give the final answer within \\boxed{}.")
GEO3K_DATA_SOURCE = "hiyouga/geometry3k"
GSM8K_DATA_SOURCE = "openai/gsm8k"
MATH_DATA_SOURCE = "lighteval/MATH"


class BadRowError(ValueError):
    """A JSONL row that cannot be converted; the message names file and line."""


def extract_gsm8k_answer(answer: str) -> str:
    """The number after the last `####`, with thousands separators removed."""
    if "####" not in answer:
        raise ValueError("answer has no '#### N' final line")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "")
    if not final:
        raise ValueError("nothing after '####' in answer")
    return final


def extract_last_boxed(text: str) -> str:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; nested braces are kept."""
    starts = [(text.rfind(cmd), cmd) for cmd in ("\\boxed{", "\\fbox{")]
    start, cmd = max(starts)
    if start == -1:
        raise ValueError("solution has no \\boxed{...}")
    depth = 0
    begin = start + len(cmd)
    for pos in range(begin - 1, len(text)):
        if text[pos] == "{":
            depth += 1
        elif text[pos] == "}":
            depth -= 1
            if depth == 0:
                content = text[begin:pos].strip()
                if not content:
                    raise ValueError("empty \\boxed{}")
                return content
    raise ValueError("unbalanced braces in the last \\boxed{...}")


def convert_gsm8k_row(record: dict[str, Any], *, index: int, split: str, instruction: str, data_source: str) -> dict:
    question, answer = _require_str(record, "question"), _require_str(record, "answer")
    return make_prompt_row(
        messages=[{"role": "user", "content": f"{question} {instruction}".strip()}],
        ground_truth=extract_gsm8k_answer(answer),
        data_source=data_source,
        extra_info={"split": split, "index": index, "question": question, "answer": answer},
    )


def convert_math_row(record: dict[str, Any], *, index: int, split: str, instruction: str, data_source: str) -> dict:
    problem, solution = _require_str(record, "problem"), _require_str(record, "solution")
    return make_prompt_row(
        messages=[{"role": "user", "content": f"{problem} {instruction}".strip()}],
        ground_truth=extract_last_boxed(solution),
        data_source=data_source,
        extra_info={"split": split, "index": index, "level": str(record.get("level", "")),
                    "type": str(record.get("type", ""))},
    )


def convert_geo3k_row(record: dict[str, Any], *, index: int, split: str, instruction: str, data_source: str) -> dict:
    problem = _require_str(record, "problem")
    answer = record.get("answer")
    if answer is None or isinstance(answer, (dict, list)) or not str(answer).strip():
        raise ValueError(f"field 'answer' must be a non-empty string or number, got {answer!r:.100}")
    images = read_image_entries(record.get("images"), "images")
    check_one_placeholder_per_image(images, problem)
    if not images:
        raise ValueError(f"no image: a geometry3k problem comes with its figure ({problem!r:.100})")
    return make_prompt_row(
        messages=[{"role": "user", "content": f"{problem} {instruction}".strip()}],
        ground_truth=str(answer).strip(), data_source=data_source,
        extra_info={"split": split, "index": index, "question": problem, "answer": str(answer)},
        images=images,
    )


def make_generic_converter(prompt_field: str, answer_field: str) -> Callable[..., dict]:
    def convert(record: dict[str, Any], *, index: int, split: str, instruction: str, data_source: str) -> dict:
        prompt = _require_str(record, prompt_field)
        answer = record.get(answer_field)
        if answer is None or isinstance(answer, (dict, list)):
            raise ValueError(f"field {answer_field!r} must be a string or number, got {answer!r:.100}")
        content = f"{prompt} {instruction}".strip() if instruction else prompt
        return make_prompt_row(
            messages=[{"role": "user", "content": content}],
            ground_truth=str(answer),
            data_source=data_source,
            extra_info={"split": split, "index": index},
        )

    return convert


def convert_parquet_file(
    path: str | Path, convert: Callable[..., dict], *, split: str, instruction: str, data_source: str
) -> list[dict]:
    """Convert every row; a bad row raises `BadRowError` naming the file and 0-based row."""
    import pyarrow.parquet as pq

    path = _existing_input(path)
    try:
        records = pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises several types for a non-parquet file
        raise BadRowError(f"{path}: cannot read as parquet: {err}") from None
    return _convert_records(path, ((f"row {row}", record) for row, record in enumerate(records)), lambda r: r,
                            convert, split=split, instruction=instruction, data_source=data_source)


def convert_jsonl_file(
    path: str | Path, convert: Callable[..., dict], *, split: str, instruction: str, data_source: str
) -> list[dict]:
    """Convert every non-blank line; a bad line raises `BadRowError` naming the file and 1-based line number."""
    path = _existing_input(path)
    with path.open(encoding="utf-8") as handle:
        lines = ((f"line {line_no}", line) for line_no, line in enumerate(handle, start=1) if line.strip())
        return _convert_records(path, lines, _json_object, convert, split=split, instruction=instruction,
                                data_source=data_source)


def _existing_input(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    return path


def _json_object(line: str) -> dict[str, Any]:
    record = json.loads(line)  # json.JSONDecodeError is a ValueError
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    return record


def _convert_records(path: Path, labelled: Iterable[tuple[str, Any]], parse: Callable[[Any], dict],
                     convert: Callable[..., dict], *, split: str, instruction: str, data_source: str) -> list[dict]:
    """``convert(parse(raw))`` for each (label, raw) of ``path``; the first failure names the file and label."""
    rows = []
    for label, raw in labelled:
        try:
            rows.append(convert(parse(raw), index=len(rows), split=split, instruction=instruction,
                                data_source=data_source))
        except (ValueError, KeyError) as err:
            raise BadRowError(f"{path} {label}: {err}") from None
    if not rows:
        raise BadRowError(f"{path}: no rows")
    return rows


def _require_str(record: dict[str, Any], key: str) -> str:
    if key not in record:
        raise ValueError(f"missing field {key!r} (fields present: {sorted(record)})")
    value = record[key]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field {key!r} must be a non-empty string, got {value!r:.100}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megarl.data.preprocess", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    defaults = {"gsm8k": (GSM8K_DATA_SOURCE, GSM8K_INSTRUCTION), "math": (MATH_DATA_SOURCE, MATH_INSTRUCTION),
                "jsonl": (None, ""), "geo3k": (GEO3K_DATA_SOURCE, GEO3K_INSTRUCTION)}
    for kind, (source, instruction) in defaults.items():
        p = sub.add_parser(kind)
        kind_of_file = "parquet" if kind == "geo3k" else "JSONL"
        p.add_argument("--input", required=True, help=f"train {kind_of_file} file")
        p.add_argument("--test-input", help=f"optional test {kind_of_file} file, written as test.parquet")
        p.add_argument("--output", required=True, help="output directory")
        p.add_argument("--data-source", default=source, required=source is None,
                       help=f"data_source column (default {source!r})" if source else "data_source column")
        p.add_argument("--instruction", default=instruction, help="text appended to every prompt")
        p.add_argument("--system", help="a system message put before every prompt")
        if kind == "gsm8k":
            p.add_argument("--with-tools", action="store_true",
                           help="the system message of multi-turn tool rollouts (see configs/qwen2_5_7b_gsm8k_tools_grpo.yaml)")
        if kind == "jsonl":
            p.add_argument("--prompt-field", required=True)
            p.add_argument("--answer-field", required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.kind == "gsm8k":
        convert = convert_gsm8k_row
    elif args.kind == "math":
        convert = convert_math_row
    elif args.kind == "geo3k":
        convert = convert_geo3k_row
    else:
        convert = make_generic_converter(args.prompt_field, args.answer_field)
    out = Path(args.output)
    inputs = [("train", args.input)] + ([("test", args.test_input)] if args.test_input else [])
    try:
        # Convert everything before writing anything: a bad test file must not leave a lone train.parquet.
        read = convert_parquet_file if args.kind == "geo3k" else convert_jsonl_file
        converted = [(split, read(path, convert, split=split, instruction=args.instruction,
                                  data_source=args.data_source)) for split, path in inputs]
    except (BadRowError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    system = GSM8K_TOOLS_SYSTEM if getattr(args, "with_tools", False) else args.system
    for split, rows in converted:
        if system:
            for row in rows:
                row["prompt"].insert(0, {"role": "system", "content": system})
        written = write_prompt_rows(rows, out / f"{split}.parquet")
        print(f"wrote {len(rows)} rows to {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
