"""The synthetic digit task: a demo dataset a random-init tiny model can learn with GRPO on CPU.

Prompts are one short user message, `<op> <digits>`; answers are 1-3 digits with exact ground truth:

    copy 37     -> 37       (default: learnable by attention alone, so reward rises within tens of steps)
    reverse 37  -> 73
    add 12 34   -> 46       (operands of `num_digits` digits; the sum may have one more digit)

`write_digits_dataset` writes train/val parquet files in the `RLDataset` layout (data_source
"synthetic/digits"); `resolve_data_files` maps a data spec (`embedded:digits[?op=..&num_digits=..]`,
`embedded:shapes[?kinds=count,colour&..]` for the image task of `megarl.data.shapes_task`, or local parquet paths)
to files. The scorers are `megarl.rewards.synthetic_task`'s.

Left out: curricula and tasks needing multi-step reasoning; this exists to show the RL loop learns.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Sequence
from urllib.parse import parse_qsl

from megarl.data.cache import default_cache_root
from megarl.data.rows import make_prompt_row, write_prompt_rows
from megarl.data.tokenizer import unsupported_characters

DATA_SOURCE = "synthetic/digits"
EMBEDDED_DIGITS = "embedded:digits"
EMBEDDED_SHAPES = "embedded:shapes"
DIGIT_OPS = ("copy", "reverse", "add")

# Defaults of the embedded spec: enough distinct train prompts for a 100-step demo, a small val set.
DEFAULT_N_TRAIN = 4096
DEFAULT_N_VAL = 128
DEFAULT_SEED = 0


def make_digits_example(rng: random.Random, *, op: str, num_digits: int) -> tuple[str, str]:
    """Draw one (user message, answer) pair. Digit strings keep leading zeros: 'copy 07' -> '07'."""
    if op not in DIGIT_OPS:
        raise ValueError(f"unknown digits op {op!r}; known: {list(DIGIT_OPS)}")
    if op == "add":
        a, b = (rng.randrange(10**num_digits) for _ in range(2))
        return f"add {a} {b}", str(a + b)
    digits = "".join(rng.choice("0123456789") for _ in range(num_digits))
    return f"{op} {digits}", digits if op == "copy" else digits[::-1]


def write_digits_dataset(
    out_dir: str | Path, n_train: int, n_val: int, seed: int, op: str = "copy", num_digits: int = 2
) -> tuple[Path, Path]:
    """Write `train.parquet` and `val.parquet` into `out_dir`; return their paths. Deterministic in the args."""
    if op not in DIGIT_OPS:
        raise ValueError(f"unknown digits op {op!r}; known: {list(DIGIT_OPS)}")
    # Answers must stay 1-3 digits (see module docstring): add of 2-digit operands gives up to 3.
    max_digits = 2 if op == "add" else 3
    if not 1 <= num_digits <= max_digits:
        raise ValueError(f"num_digits={num_digits} out of range 1..{max_digits} for op {op!r}")
    if n_train < 1 or n_val < 1:
        raise ValueError(f"n_train and n_val must be >= 1, got n_train={n_train}, n_val={n_val}")
    out = Path(out_dir)
    paths = []
    for split, n in (("train", n_train), ("val", n_val)):
        # Separate string-seeded streams: the val set does not shift when n_train changes.
        rng = random.Random(f"megarl-digits-{seed}-{split}")
        rows = []
        for index in range(n):
            question, answer = make_digits_example(rng, op=op, num_digits=num_digits)
            bad = unsupported_characters(question)
            if bad:
                raise AssertionError(f"digits prompt {question!r} has characters outside the local tokenizer: {bad}")
            rows.append(
                make_prompt_row(
                    messages=[{"role": "user", "content": question}],
                    ground_truth=answer,
                    data_source=DATA_SOURCE,
                    extra_info={"split": split, "index": index, "op": op},
                )
            )
        paths.append(write_prompt_rows(rows, out / f"{split}.parquet"))
    return paths[0], paths[1]


def resolve_data_files(
    spec: str | Path | Sequence[str | Path], *, split: str = "train", cache_root: str | Path | None = None
) -> list[Path]:
    """Map a data spec to parquet paths.

    `embedded:digits` (optionally `?op=reverse&num_digits=3&n_train=..&n_val=..&seed=..`) generates the digits
    dataset once into `<cache root>/data/` and returns its `split` ("train" or "val") file; `embedded:shapes`
    (optionally `?kinds=count,colour,shape&size=64&n_train=..&n_val=..&seed=..`) the shapes images likewise.
    Anything else is one path or a list of paths to local parquet files, each checked to exist.
    """
    specs = [spec] if isinstance(spec, (str, Path)) else list(spec)
    if not specs:
        raise ValueError("empty data file list")
    files: list[Path] = []
    for item in specs:
        text = str(item)
        if text.startswith(EMBEDDED_DIGITS):
            files.append(_ensure_embedded_digits(text, split=split, cache_root=cache_root))
            continue
        if text.startswith(EMBEDDED_SHAPES):
            files.append(_ensure_embedded_shapes(text, split=split, cache_root=cache_root))
            continue
        path = Path(text).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"data file {text!r} does not exist (expected a local parquet file, "
                                    f"'{EMBEDDED_DIGITS}' or '{EMBEDDED_SHAPES}'; dataset downloads are not done)")
        if path.suffix != ".parquet":
            raise ValueError(f"data file {text!r} is not a .parquet file")
        files.append(path)
    return files


def _ensure_embedded_digits(spec: str, *, split: str, cache_root: str | Path | None) -> Path:
    defaults = {"op": "copy", "num_digits": "2", "n_train": str(DEFAULT_N_TRAIN), "n_val": str(DEFAULT_N_VAL),
                "seed": str(DEFAULT_SEED)}
    params = _spec_params(spec, EMBEDDED_DIGITS, split, defaults)
    op = params["op"]
    num_digits, n_train, n_val, seed = (_int(params, key, spec) for key in ("num_digits", "n_train", "n_val", "seed"))
    return _generated(cache_root, f"digits-{op}-d{num_digits}-n{n_train}-v{n_val}-s{seed}", split,
                      lambda out: write_digits_dataset(out, n_train, n_val, seed, op=op, num_digits=num_digits))


def _ensure_embedded_shapes(spec: str, *, split: str, cache_root: str | Path | None) -> Path:
    from megarl.data.shapes_task import QUESTIONS, write_shapes_dataset

    params = _spec_params(spec, EMBEDDED_SHAPES, split, {"kinds": ",".join(QUESTIONS), "size": "64",
                                                         "n_train": "1024", "n_val": "64", "seed": str(DEFAULT_SEED)})
    kinds = tuple(kind for kind in params["kinds"].split(",") if kind)
    size, n_train, n_val, seed = (_int(params, key, spec) for key in ("size", "n_train", "n_val", "seed"))
    return _generated(cache_root, f"shapes-{'-'.join(kinds)}-px{size}-n{n_train}-v{n_val}-s{seed}", split,
                      lambda out: write_shapes_dataset(out, n_train=n_train, n_val=n_val, seed=seed, size=size,
                                                       kinds=kinds))


def _generated(cache_root: str | Path | None, name: str, split: str, write) -> Path:
    """``<cache root>/data/<name>/<split>.parquet``, ``write(folder)`` run the first time. Each file is written
    atomically (megarl.data.rows), so runs or ranks asking at once never read half a file."""
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / "data" / name / f"{split}.parquet"
    if not target.is_file():
        write(target.parent)
    return target


def _spec_params(spec: str, prefix: str, split: str, defaults: dict[str, str]) -> dict[str, str]:
    """The spec's ``?key=value&..`` over ``defaults``; unknown keys are refused."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val' for {spec!r}, got {split!r}")
    _, _, query = spec.partition("?")
    if spec[len(prefix):] and not spec[len(prefix):].startswith("?"):
        raise ValueError(f"bad embedded data spec {spec!r}; expected '{prefix}' or '{prefix}?key=value&..'")
    params = dict(defaults)
    for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key not in params:
            raise ValueError(f"unknown parameter {key!r} in data spec {spec!r}; known: {sorted(params)}")
        params[key] = value
    return params


def _int(params: dict[str, str], key: str, spec: str) -> int:
    try:
        return int(params[key])
    except ValueError:
        raise ValueError(f"non-integer parameter in data spec {spec!r}: {key}={params[key]!r}") from None
