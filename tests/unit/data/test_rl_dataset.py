"""RLDataset on real parquet files written here with pyarrow: columns, errors, overlong prompts, collation."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from megarl.data.dataset import RLDataset, collate_prompts
from megarl.data.tokenizer import write_local_tokenizer

@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_local_tokenizer(tmp_path_factory.mktemp("tok")))


def _write(path, questions, answers=None, *, extra=None, drop=(), data_source=True):
    answers = answers or [str(i) for i in range(len(questions))]
    columns = {
        "prompt": [[{"role": "user", "content": q}] for q in questions],
        "reward_model": [{"ground_truth": a, "style": "rule"} for a in answers],
    }
    if data_source:
        columns["data_source"] = ["synthetic/digits"] * len(questions)
    if extra is not None:
        columns["extra_info"] = extra
    for name in drop:
        columns.pop(name)
    pq.write_table(pa.table(columns), path)
    return path


def _prompt_len(question):
    # <|im_start|> user \n q <|im_end|> \n <|im_start|> assistant \n, one token per character.
    return 1 + 5 + len(question) + 1 + 1 + 1 + 10


def test_items_carry_ids_and_fields(tmp_path, tokenizer):
    path = _write(tmp_path / "a.parquet", ["copy 37", "add 1 2"], ["37", "3"],
                  extra=[json.dumps({"k": 1}), None])
    ds = RLDataset(path, tokenizer, max_prompt_length=64)
    assert len(ds) == 2 and ds.num_filtered == 0
    first = ds[0]
    expected_text = "<|im_start|>user\ncopy 37<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(first.input_ids) == expected_text
    assert len(first.input_ids) == _prompt_len("copy 37")
    assert first.raw_prompt == [{"role": "user", "content": "copy 37"}]
    assert (first.ground_truth, first.data_source, first.extra_info, first.index) == ("37", "synthetic/digits",
                                                                                     {"k": 1}, 0)
    assert (ds[1].extra_info, ds[1].index, ds[1].source_row, ds[1].reward_style) == ({}, 1, 1, "rule")


def test_struct_and_map_extra_info_and_default_data_source(tmp_path, tokenizer):
    struct_file = _write(tmp_path / "s.parquet", ["copy 1"], extra=[{"split": "train", "index": 5}],
                         data_source=False)
    map_type = pa.map_(pa.string(), pa.int64())
    table = pa.table({
        "prompt": [[{"role": "user", "content": "copy 2"}]],
        "reward_model": [{"ground_truth": "2"}],
        "extra_info": pa.array([[("a", 1), ("b", 2)]], type=map_type),
    })
    map_file = tmp_path / "m.parquet"
    pq.write_table(table, map_file)
    ds = RLDataset([struct_file, map_file], tokenizer, max_prompt_length=64)
    assert ds[0].extra_info == {"split": "train", "index": 5} and ds[0].data_source == "unknown"
    assert ds[1].extra_info == {"a": 1, "b": 2} and ds[1].reward_style is None
    assert [item.index for item in ds.items] == [0, 1]
    assert (ds[1].source_file, ds[1].source_row) == (str(map_file), 0)


def test_missing_column_names_file_and_columns(tmp_path, tokenizer):
    path = _write(tmp_path / "bad.parquet", ["copy 1"], drop=("reward_model",))
    with pytest.raises(ValueError, match=r"bad\.parquet: missing column 'reward_model' \(columns present: "
                                         r"\['prompt', 'data_source'\]\)"):
        RLDataset(path, tokenizer, max_prompt_length=64)
    with pytest.raises(ValueError, match="missing column 'question'"):
        RLDataset(_write(tmp_path / "ok.parquet", ["copy 1"]), tokenizer, prompt_key="question",
                  max_prompt_length=64)


def test_bad_rows_name_file_and_row(tmp_path, tokenizer):
    table = pa.table({"prompt": [[{"role": "user", "content": "copy 1"}], []],
                      "reward_model": [{"ground_truth": "1"}, {"ground_truth": "2"}]})
    pq.write_table(table, tmp_path / "empty_prompt.parquet")
    with pytest.raises(ValueError, match=r"empty_prompt\.parquet row 1: column 'prompt' must be a non-empty list"):
        RLDataset(tmp_path / "empty_prompt.parquet", tokenizer, max_prompt_length=64)
    table = pa.table({"prompt": [[{"role": "user", "content": "copy 1"}]] * 2,
                      "reward_model": [{"ground_truth": "1"}, {"ground_truth": None}]})
    pq.write_table(table, tmp_path / "no_gt.parquet")
    with pytest.raises(ValueError, match=r"no_gt\.parquet row 1: reward_model\.ground_truth is missing"):
        RLDataset(tmp_path / "no_gt.parquet", tokenizer, max_prompt_length=64)
    path = _write(tmp_path / "json.parquet", ["copy 1", "copy 2"], extra=["{}", "{nope"])
    with pytest.raises(ValueError, match=r"json\.parquet row 1: extra_info is a string but not valid JSON"):
        RLDataset(path, tokenizer, max_prompt_length=64)
    with pytest.raises(FileNotFoundError, match="nothere.parquet"):
        RLDataset(tmp_path / "nothere.parquet", tokenizer, max_prompt_length=64)


def test_overlong_prompts_are_filtered_and_reported(tmp_path, tokenizer):
    questions = ["copy 1", "x" * 40, "copy 22", "y" * 50, "z" * 45, "w" * 41, "v" * 42, "u" * 43, "copy 3"]
    path = _write(tmp_path / "long.parquet", questions)
    limit = _prompt_len("copy 22")
    with pytest.warns(UserWarning, match=r"long\.parquet: filtered 6 of 9 prompts longer than max_prompt_length="
                                         rf"{limit} tokens \(rows \[1, 3, 4, 5, 6\] and 1 more\)"):
        ds = RLDataset(path, tokenizer, max_prompt_length=limit)
    assert ds.num_filtered == 6 and [item.source_row for item in ds.items] == [0, 2, 8]
    assert ds.filtered_rows[0] == (str(path), 1, _prompt_len("x" * 40))
    assert [item.index for item in ds.items] == [0, 1, 2]
    with pytest.raises(ValueError, match="no prompts left"), pytest.warns(UserWarning, match="filtered 9 of 9"):
        RLDataset(path, tokenizer, max_prompt_length=5)


def test_truncation_modes_without_filtering(tmp_path, tokenizer):
    path = _write(tmp_path / "t.parquet", ["copy 1", "copy 12345"])
    limit = _prompt_len("copy 1")
    with pytest.raises(ValueError, match=rf"t\.parquet row 1: prompt has {_prompt_len('copy 12345')} tokens > "
                                         rf"max_prompt_length={limit}"):
        RLDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False)
    full = tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": "copy 12345"}],
                                                   add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
    left = RLDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation="left")
    right = RLDataset(path, tokenizer, max_prompt_length=limit, filter_overlong_prompts=False, truncation="right")
    assert left[1].input_ids == full[-limit:] and right[1].input_ids == full[:limit]
    assert left[0].input_ids == right[0].input_ids and len(left[0].input_ids) == limit
    with pytest.raises(ValueError, match="truncation must be one of"):
        RLDataset(path, tokenizer, max_prompt_length=limit, truncation="middle")


def test_raw_string_prompts_without_chat_template(tmp_path, tokenizer):
    pq.write_table(pa.table({"text": ["copy 37"], "reward_model": [{"ground_truth": "37"}]}), tmp_path / "r.parquet")
    ds = RLDataset(tmp_path / "r.parquet", tokenizer, prompt_key="text", max_prompt_length=16,
                   apply_chat_template=False)
    assert tokenizer.decode(ds[0].input_ids) == "copy 37"
    with pytest.raises(ValueError, match="column 'prompt' must be a string when apply_chat_template=False"):
        RLDataset(_write(tmp_path / "m.parquet", ["copy 1"]), tokenizer, max_prompt_length=64,
                  apply_chat_template=False)


def test_collate_keeps_each_prompts_tokens_unpadded(tmp_path, tokenizer):
    ds = RLDataset(_write(tmp_path / "c.parquet", ["copy 1", "copy 1234", "add 12 3"], ["1", "1234", "15"]),
                   tokenizer, max_prompt_length=64)
    batch = collate_prompts([ds[0], ds[1], ds[2]])
    assert len(batch) == 3 and len({len(ids) for ids in batch.prompt_ids}) > 1
    assert batch.prompt_ids == [ds[row].input_ids for row in range(3)]
    assert batch.ground_truths == ["1", "1234", "15"] and batch.indices == [0, 1, 2]
    with pytest.raises(ValueError, match="empty list"):
        collate_prompts([])


def test_empty_parquet_says_empty(tmp_path, tokenizer):
    path = _write(tmp_path / "none.parquet", ["copy 1"])
    pq.write_table(pq.read_table(path).slice(0, 0), path)  # the same columns, 0 rows
    with pytest.raises(ValueError, match=r"no rows in .*none.parquet.*empty"):
        RLDataset(path, tokenizer, max_prompt_length=64)


def test_tool_schemas_are_rendered_into_prompts_and_counted(tmp_path):
    """Multi-turn rollouts: the tools' schemas reach the chat template (as Qwen's renders them into the system
    turn), so prompt lengths and the overlong filter see them."""
    import copy

    tok = AutoTokenizer.from_pretrained(write_local_tokenizer(tmp_path / "tok"))
    tok = copy.deepcopy(tok)
    tok.chat_template = ("{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}"
                         "{% endfor %}<|im_end|>{{ '\\n' }}{%- endif %}" + tok.chat_template)
    schema = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}
    path = _write(tmp_path / "a.parquet", ["copy 37"])
    with_tools = RLDataset(path, tok, max_prompt_length=64, tools=[schema])
    assert tok.decode(with_tools[0].input_ids).startswith("<|im_start|>system\ntools: calculator<|im_end|>\n")
    assert len(with_tools[0].input_ids) == len(RLDataset(path, tok, max_prompt_length=64)[0].input_ids) + 27
    with pytest.warns(UserWarning, match="filtered 1 of 1"):
        with pytest.raises(ValueError, match="no prompts left"):
            RLDataset(path, tok, max_prompt_length=_prompt_len("copy 37"), tools=[schema])
