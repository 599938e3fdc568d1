"""The preprocess CLI on small JSONL files written here; output read back with pyarrow and RLDataset."""

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from megarl.data.preprocess import GSM8K_INSTRUCTION, extract_gsm8k_answer, extract_last_boxed, main


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A car costs 1200 plus 300.", "answer": "1200+300=1500\n#### 1,500"},
]


def test_gsm8k_train_and_test(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", GSM8K)
    test = _jsonl(tmp_path / "test.jsonl", GSM8K[:1])
    assert main(["gsm8k", "--input", str(train), "--test-input", str(test), "--output", str(tmp_path / "out")]) == 0
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1500"]
    assert rows[0]["prompt"] == [{"role": "user", "content": GSM8K[0]["question"] + " " + GSM8K_INSTRUCTION}]
    assert GSM8K_INSTRUCTION == "Let's think step by step and output the final answer after \"####\"."
    assert rows[1]["data_source"] == "openai/gsm8k" and rows[1]["extra_info"]["index"] == 1
    assert rows[1]["extra_info"]["split"] == "train" and rows[1]["reward_model"]["style"] == "rule"
    assert pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()[0]["extra_info"]["split"] == "test"


def test_gsm8k_bad_row_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GSM8K[0]) + "\n\n" + json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    assert main(["gsm8k", "--input", str(bad), "--output", str(tmp_path / "out")]) == 2
    assert f"{bad} line 3: answer has no '#### N'" in capsys.readouterr().err
    assert not (tmp_path / "out" / "train.parquet").exists()
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    assert main(["gsm8k", "--input", str(broken), "--output", str(tmp_path / "out")]) == 2
    assert f"{broken} line 2:" in capsys.readouterr().err
    missing = _jsonl(tmp_path / "missing.jsonl", [{"question": "q"}])
    assert main(["gsm8k", "--input", str(missing), "--output", str(tmp_path / "out")]) == 2
    assert "line 1: missing field 'answer' (fields present: ['question'])" in capsys.readouterr().err


def test_math_extracts_last_boxed(tmp_path):
    records = [
        {"problem": "Compute 1/2 + 1/2.", "solution": "First \\boxed{wrong}, then \\boxed{1}.", "level": "Level 1"},
        {"problem": "Simplify.", "solution": "So $\\boxed{\\frac{1}{2}}$", "type": "Algebra"},
    ]
    src = _jsonl(tmp_path / "math.jsonl", records)
    assert main(["math", "--input", str(src), "--output", str(tmp_path / "out")]) == 0
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1", "\\frac{1}{2}"]
    assert rows[0]["prompt"][0]["content"].endswith("within \\boxed{}.")
    assert rows[1]["data_source"] == "lighteval/MATH" and rows[1]["extra_info"]["type"] == "Algebra"
    bad = _jsonl(tmp_path / "bad.jsonl", records + [{"problem": "p", "solution": "\\boxed{1"}])
    with pytest.raises(SystemExit):  # argparse path untouched; error path returns 2
        main(["math"])
    assert main(["math", "--input", str(bad), "--output", str(tmp_path / "o2")]) == 2


def test_extractors():
    assert extract_gsm8k_answer("a #### 1 #### 2,000 ") == "2000"
    assert extract_last_boxed("\\boxed{a{b}c} and \\fbox{d}") == "d"
    assert extract_last_boxed("\\fbox{d} then \\boxed{ {x} }") == "{x}"
    for text, message in [("none", "no \\\\boxed"), ("\\boxed{}", "empty"), ("\\boxed{a", "unbalanced")]:
        with pytest.raises(ValueError, match=message):
            extract_last_boxed(text)


@pytest.mark.timeout(120)
def test_generic_jsonl_through_the_real_cli(tmp_path):
    src = _jsonl(tmp_path / "qa.jsonl", [{"q": "copy 12", "a": 12}, {"q": "copy 3", "a": "3"}])
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "megarl.data.preprocess", "jsonl", "--input", str(src), "--output", str(out),
         "--prompt-field", "q", "--answer-field", "a", "--data-source", "synthetic/digits"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert f"wrote 2 rows to {out / 'train.parquet'}" in result.stdout
    rows = pq.read_table(out / "train.parquet").to_pylist()
    assert [r["prompt"][0]["content"] for r in rows] == ["copy 12", "copy 3"]
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["12", "3"]
    assert {r["data_source"] for r in rows} == {"synthetic/digits"}
    # Readable by the dataset with the local tokenizer end to end.
    from transformers import AutoTokenizer

    from megarl.data.dataset import RLDataset
    from megarl.data.tokenizer import write_local_tokenizer

    ds = RLDataset(out / "train.parquet", AutoTokenizer.from_pretrained(write_local_tokenizer(tmp_path / "t")),
                   max_prompt_length=64)
    assert len(ds) == 2 and ds[0].ground_truth == "12"
    bad = _jsonl(tmp_path / "bad.jsonl", [{"q": "x", "a": None}])
    assert main(["jsonl", "--input", str(bad), "--output", str(out), "--prompt-field", "q",
                 "--answer-field", "a", "--data-source", "x"]) == 2


def test_gsm8k_with_tools_and_a_system_message(tmp_path):
    from megarl.data.preprocess import GSM8K_TOOLS_SYSTEM

    train = _jsonl(tmp_path / "train.jsonl", GSM8K)
    assert main(["gsm8k", "--with-tools", "--input", str(train), "--output", str(tmp_path / "tools")]) == 0
    rows = pq.read_table(tmp_path / "tools" / "train.parquet").to_pylist()
    assert rows[0]["prompt"][0] == {"role": "system", "content": GSM8K_TOOLS_SYSTEM}
    assert rows[0]["prompt"][1]["role"] == "user" and len(rows[0]["prompt"]) == 2
    assert main(["jsonl", "--input", str(train), "--output", str(tmp_path / "own"), "--prompt-field", "question",
                 "--answer-field", "answer", "--data-source", "x", "--system", "be brief"]) == 0
    rows = pq.read_table(tmp_path / "own" / "train.parquet").to_pylist()
    assert rows[1]["prompt"][0] == {"role": "system", "content": "be brief"}
