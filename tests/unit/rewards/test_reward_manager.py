"""RewardManager routing, custom functions loaded from files, error policies, token placement."""

import math

import pytest
import torch

from megarl.rewards import RewardError, RewardManager, load_custom_reward_fn, place_scores_on_last_token


def test_default_routing_scores_each_source():
    manager = RewardManager()
    result = manager.score_batch(
        data_sources=["openai/gsm8k", "gsm8k", "lighteval/MATH", "math_dapo"],
        solution_strs=["#### 72", "#### 5", r"\boxed{\frac{1}{2}}", r"\boxed{7}"],
        ground_truths=["72", "6", "0.5", "7"],
    )
    assert result.scores.dtype == torch.float32
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert result.metrics["reward/openai/gsm8k/mean_score"] == 1.0
    assert result.metrics["reward/gsm8k/mean_score"] == 0.0
    assert result.metrics["reward/mean_score"] == 0.75
    assert result.metrics["reward/num_errors"] == 0.0


def test_synthetic_digits_route_is_lazy_string():
    from megarl.rewards.routing import DEFAULT_ROUTES

    assert DEFAULT_ROUTES["synthetic/digits"] == "megarl.rewards.synthetic_task:score_digits"
    result = RewardManager().score_batch(["synthetic/digits"], ["1234"], ["1234"])
    assert result.scores.tolist() == [1.0]


def test_unknown_data_source_lists_known_ones_even_with_zero_policy():
    with pytest.raises(ValueError, match=r"'my_set' \(sample 1\); known: .*gsm8k.*synthetic/digits.*aime\*.*"
                                         r"reward_model.custom_function.path"):
        RewardManager(on_error="zero").score_batch(["gsm8k", "my_set"], ["#### 1", "x"], ["1", "2"])


# Every math data_source verl's default scorer routes (verl/utils/reward_score/__init__.py); openai/gsm8k is
# tested above and the code-execution sources below.
VERL_SOURCES = ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
                "math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime_2025", "numina_aops_forum",
                "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
                "numina_olympiads", "hiyouga/geometry3k"]


@pytest.mark.parametrize("source", VERL_SOURCES)
def test_every_verl_math_source_is_routed(source):
    right, wrong = RewardManager().score_batch([source, source], [r"so \boxed{-\frac{1}{2}}", r"\boxed{2}"],
                                               ["-1/2", "-1/2"]).scores.tolist()
    assert (right, wrong) == (1.0, 0.0)


@pytest.mark.parametrize("source", ["math_dapo", "aime2024", "numina_olympiads", "math"])
def test_dapo_answer_line_and_unicode_minus(source):
    responses = ["Let me think.\nAnswer: \u22123", "reasoning\n**Answer:** -3.", "\\boxed{4}\nAnswer: -3",
                 "Answer: -3\nactually \\boxed{4}", "no final line, -3"]
    assert RewardManager().score_batch([source] * 5, responses, ["-3"] * 5).scores.tolist() == [1, 1, 1, 0, 0]


def test_unicode_minus_in_gsm8k_and_boxed_math():
    result = RewardManager().score_batch(["openai/gsm8k", "lighteval/MATH"], ["#### \u221212", "\\boxed{\u22120.5}"],
                                         ["-12", r"-\frac{1}{2}"])
    assert result.scores.tolist() == [1.0, 1.0]


def test_code_sources_say_how_to_score_them():
    with pytest.raises(ValueError, match=r"'codeforces' .* running code.*reward_model.custom_function.path"):
        RewardManager().score_batch(["codeforces"], ["print(1)"], ["1"])


def test_length_mismatch_names_field():
    with pytest.raises(ValueError, match="ground_truths has 1 entries but solution_strs has 2"):
        RewardManager().score_batch(["gsm8k", "gsm8k"], ["#### 1", "#### 2"], ["1"])


def test_custom_route_overrides_default():
    manager = RewardManager(routes={"gsm8k": lambda s, gt: 0.25, "mine": "megarl.rewards.format_reward:score_format"})
    result = manager.score_batch(["gsm8k", "mine"], ["#### 1", "<think>x</think> y"], ["1", ""])
    assert result.scores.tolist() == [0.25, 1.0]


CUSTOM_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info):
    correct = solution_str.strip() == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": solution_str.strip(),
            "split": extra_info.get("split", "?")}

def plain(data_source, solution_str, ground_truth, extra_info):
    return len(solution_str)

NOT_A_FUNCTION = 3
'''


def test_custom_function_from_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM_FILE)
    fn = load_custom_reward_fn(path, "compute_score")
    result = RewardManager(custom_fn=fn).score_batch(
        data_sources=["anything", "anything", "other"],
        solution_strs=["a", "b ", "c"],
        ground_truths=["a", "b", "x"],
        extra_infos=[{"split": "train"}, None, {}],
    )
    assert result.scores.tolist() == [1.0, 1.0, -1.0]  # unknown data sources are fine: the custom fn scores all
    assert result.extra_infos[0] == {"acc": True, "pred": "a", "split": "train"}
    assert result.extra_infos[1]["split"] == "?"
    assert result.metrics["reward/extra/acc/mean"] == pytest.approx(2 / 3)
    assert "reward/extra/pred/mean" not in result.metrics
    assert result.metrics["reward/anything/mean_score"] == 1.0
    assert load_custom_reward_fn(path, "plain")("d", "abc", "", {}) == 3


def test_custom_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="custom reward file not found: .*missing.py"):
        load_custom_reward_fn(tmp_path / "missing.py", "compute_score")
    path = tmp_path / "r.py"
    path.write_text(CUSTOM_FILE)
    with pytest.raises(AttributeError, match=r"no function 'score_fn'; callables there: \['compute_score', 'plain'\]"):
        load_custom_reward_fn(path, "score_fn")
    with pytest.raises(TypeError, match="'NOT_A_FUNCTION' .* is a int, not a function"):
        load_custom_reward_fn(path, "NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(ImportError, match="broken.py: ModuleNotFoundError"):
        load_custom_reward_fn(broken, "compute_score")


def _raising(solution_str, ground_truth):
    raise KeyError("boom")


BAD_SCORERS = {
    "raises": _raising,
    "nan": lambda s, gt: float("nan"),
    "inf": lambda s, gt: math.inf,
    "string": lambda s, gt: "1.0",
    "none": lambda s, gt: None,
    "dict_without_score": lambda s, gt: {"acc": 1.0},
}


@pytest.mark.parametrize("kind,cause", [("raises", "KeyError: 'boom'"), ("nan", "finite"), ("inf", "finite"),
                                        ("string", "must be a number"), ("none", "must be a number"),
                                        ("dict_without_score", "'score' key")])
def test_fail_policy_names_sample_source_scorer_and_cause(kind, cause):
    manager = RewardManager(routes={"ok": lambda s, gt: 1.0, "bad": BAD_SCORERS[kind]}, on_error="fail")
    with pytest.raises(RewardError) as info:
        manager.score_batch(["ok", "bad"], ["x", "y"], ["x", "y"])
    message = str(info.value)
    assert "sample 1" in message and "data_source='bad'" in message and "scorer=" in message
    assert cause in message
    if kind == "raises":
        assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("kind", sorted(BAD_SCORERS))
def test_zero_policy_scores_zero_and_counts(kind):
    manager = RewardManager(routes={"ok": lambda s, gt: 1.0, "bad": BAD_SCORERS[kind]}, on_error="zero",
                            max_error_fraction=1.0)
    result = manager.score_batch(["ok", "bad", "bad"], ["x", "y", "z"], ["x", "y", "z"])
    assert result.scores.tolist() == [1.0, 0.0, 0.0]
    assert result.metrics["reward/num_errors"] == 2.0
    assert "sample 2" in result.extra_infos[2]["reward_error"]
    assert result.metrics["reward/bad/mean_score"] == 0.0


def test_zero_policy_warns_with_the_first_error_and_fails_past_the_fraction(capsys):
    nan_everywhere = RewardManager(routes={"bad": lambda s, gt: float("nan")}, on_error="zero")
    with pytest.raises(RewardError, match=r"4 of 4 samples failed .*first: .*sample 0.*finite.*max_error_fraction=0.5"):
        nan_everywhere.score_batch(["bad"] * 4, ["a", "b", "c", "d"], ["1"] * 4)
    mostly_fine = RewardManager(routes={"ok": lambda s, gt: 1.0, "bad": lambda s, gt: float("nan")}, on_error="zero")
    result = mostly_fine.score_batch(["ok", "bad", "ok", "ok"], ["a", "b", "c", "d"], ["1"] * 4)
    assert result.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    warning = capsys.readouterr().err
    assert "1 of 4 samples failed to score" in warning and "sample 1" in warning and "finite" in warning


def test_bad_policy_name():
    with pytest.raises(ValueError, match="on_error must be one of"):
        RewardManager(on_error="skip")


def test_place_scores_on_last_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    out = place_scores_on_last_token(torch.tensor([0.5, -1.0, 2.0]), mask)
    expected = torch.tensor([[0, 0.5, 0, 0], [0, 0, 0, -1.0], [2.0, 0, 0, 0]])
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match=r"rows \[1\] of response_mask have no valid token"):
        place_scores_on_last_token(torch.tensor([1.0, 1.0]), torch.tensor([[1, 0], [0, 0]]))
