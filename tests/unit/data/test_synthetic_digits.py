"""The synthetic digit task: examples, parquet files, data specs, and the partial-credit scorer."""

import random

import pyarrow.parquet as pq
import pytest

from megarl.data.synthetic import DATA_SOURCE, make_digits_example, resolve_data_files, write_digits_dataset
from megarl.rewards.synthetic_task import score_digits


def _solve(question: str) -> str:
    op, *args = question.split(" ")
    if op == "copy":
        return args[0]
    if op == "reverse":
        return args[0][::-1]
    return str(int(args[0]) + int(args[1]))


@pytest.mark.parametrize("op,num_digits", [("copy", 2), ("reverse", 3), ("add", 2), ("copy", 1)])
def test_examples_have_exact_answers(op, num_digits):
    rng = random.Random(0)
    for _ in range(200):
        question, answer = make_digits_example(rng, op=op, num_digits=num_digits)
        assert question.startswith(op + " ") and answer == _solve(question)
        assert 1 <= len(answer) <= 3 and answer.isdigit()
        if op != "add":
            assert len(question.split(" ")[1]) == num_digits


def test_written_dataset_layout_and_determinism(tmp_path):
    train, val = write_digits_dataset(tmp_path / "a", 50, 10, seed=3, op="reverse", num_digits=2)
    again, _ = write_digits_dataset(tmp_path / "b", 50, 10, seed=3, op="reverse", num_digits=2)
    assert pq.read_table(train).equals(pq.read_table(again))
    rows = pq.read_table(train).to_pylist()
    assert len(rows) == 50 and pq.read_table(val).num_rows == 10
    assert set(rows[0]) == {"prompt", "reward_model", "data_source", "extra_info"}
    for i, row in enumerate(rows):
        (message,) = row["prompt"]
        assert message["role"] == "user" and row["data_source"] == DATA_SOURCE
        assert row["reward_model"]["ground_truth"] == _solve(message["content"])
        assert row["extra_info"] == {"split": "train", "index": i, "op": "reverse"}
    other_seed, _ = write_digits_dataset(tmp_path / "c", 50, 10, seed=4, op="reverse", num_digits=2)
    assert not pq.read_table(train).equals(pq.read_table(other_seed))


def test_bad_arguments_raise(tmp_path):
    with pytest.raises(ValueError, match="unknown digits op 'mul'"):
        write_digits_dataset(tmp_path, 4, 4, seed=0, op="mul")
    with pytest.raises(ValueError, match="num_digits=3 out of range"):
        write_digits_dataset(tmp_path, 4, 4, seed=0, op="add", num_digits=3)


def test_resolve_embedded_and_local_specs(tmp_path):
    (train,) = resolve_data_files("embedded:digits?n_train=40&n_val=8", cache_root=tmp_path)
    (val,) = resolve_data_files("embedded:digits?n_train=40&n_val=8", split="val", cache_root=tmp_path)
    assert pq.read_table(train).num_rows == 40 and pq.read_table(val).num_rows == 8
    mtime = train.stat().st_mtime_ns
    assert resolve_data_files("embedded:digits?n_train=40&n_val=8", cache_root=tmp_path) == [train]
    assert train.stat().st_mtime_ns == mtime  # cached, not rewritten
    (default,) = resolve_data_files("embedded:digits", cache_root=tmp_path)
    assert default.parent.name == "digits-copy-d2-n4096-v128-s0"
    assert resolve_data_files([str(train), val]) == [train, val]
    with pytest.raises(FileNotFoundError, match="missing.parquet"):
        resolve_data_files([str(train), str(tmp_path / "missing.parquet")])
    with pytest.raises(ValueError, match="unknown parameter 'digits'"):
        resolve_data_files("embedded:digits?digits=3", cache_root=tmp_path)
    with pytest.raises(ValueError, match="split must be"):
        resolve_data_files("embedded:digits", split="test", cache_root=tmp_path)


def test_the_embedded_shapes_task_is_generated_once_with_the_kinds_asked(tmp_path):
    spec = "embedded:shapes?kinds=count&n_train=6&n_val=2&size=56"
    (train,) = resolve_data_files(spec, cache_root=tmp_path)
    (val,) = resolve_data_files(spec, split="val", cache_root=tmp_path)
    table = pq.read_table(train).to_pylist()
    assert len(table) == 6 and pq.read_table(val).num_rows == 2
    assert all(row["prompt"][0]["content"].startswith("<image>how many shapes") for row in table)
    assert all(row["reward_model"]["ground_truth"] in "1234" and len(row["images"]) == 1 for row in table)
    mtime = train.stat().st_mtime_ns
    assert resolve_data_files(spec, cache_root=tmp_path) == [train] and train.stat().st_mtime_ns == mtime
    assert [p.name for p in train.parent.parent.iterdir()] == [train.parent.name]  # no staging folder left
    with pytest.raises(ValueError, match="choose from"):
        resolve_data_files("embedded:shapes?kinds=size", cache_root=tmp_path)
    with pytest.raises(ValueError, match="non-integer parameter.*size='big'"):
        resolve_data_files("embedded:shapes?size=big", cache_root=tmp_path)


@pytest.mark.parametrize(
    "response,target,expected",
    [
        ("37", "37", 1.0),
        ("37<|im_end|>", "37", 1.0),
        (" 37\n", "37", 1.0),
        ("", "37", 0.0),
        ("abc", "37", 0.1 * 2 / 3),  # no digit, but the length term still rewards stopping near 2
        ("3", "37", 0.1 * 1 + 0.1 * 1 / 2 + 0.7 * 1 / 2),
        ("38", "37", 0.1 + 0.1 + 0.7 / 2),
        ("73", "37", 0.1 + 0.1),
        ("378", "37", 0.1 + 0.1 * 2 / 3 + 0.7 * 2 / 3),
        ("3x", "37", 0.1 / 2 + 0.1 + 0.7 / 2),
        ("12345678", "120", 0.1 + 0.1 * 3 / 8 + 0.7 * 2 / 8),
        ("3²", "37", 0.1 / 2 + 0.1 + 0.7 / 2),
    ],
)
def test_score_digits_partial_credit(response, target, expected):
    assert score_digits(response, target) == pytest.approx(expected)


def test_score_digits_exact_is_the_unique_maximum():
    rng = random.Random(1)
    alphabet = "0123456789ab "
    for _ in range(2000):
        response = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 5)))
        score = score_digits(response, "42")
        assert 0.0 <= score <= 1.0
        assert (score == 1.0) == (response.strip() == "42")
        if response.strip() != "42":
            assert score < 0.9


def test_score_digits_rejects_non_digit_ground_truth():
    with pytest.raises(ValueError, match="ground_truth"):
        score_digits("1", "x1")
