"""The driver's side of model-based rewards: reward-model inputs (reused ids, re-tokenization, truncation),
combining sources, the judge's prompts and parser, and the config checks that name their keys."""

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from megarl.batch import RolloutBatch
from megarl.config import ConfigError
from megarl.run_config import load_config
from megarl.data.tokenizer import write_local_tokenizer
from megarl.rewards.judge import JudgeError, judge_prompt_ids, parse_judgements, question_of
from megarl.rewards.model_inputs import RewardModelInputs, combine_scores


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(write_local_tokenizer(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def word_tokenizer():
    """A different vocabulary (whole words, no chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "what", "is", "2+3?", "5", "the", "answer"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def _rollout(tokenizer, prompt: str, responses: list[str]) -> RolloutBatch:
    messages = [{"role": "user", "content": prompt}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                  add_special_tokens=False)
    width_r = max(len(tokenizer.encode(r, add_special_tokens=False)) for r in responses) + 1
    rows = len(responses)
    out = RolloutBatch(prompt_ids=torch.zeros((rows, len(prompt_ids) + 2), dtype=torch.long),
                       prompt_mask=torch.zeros((rows, len(prompt_ids) + 2), dtype=torch.long),
                       response_ids=torch.zeros((rows, width_r), dtype=torch.long),
                       response_mask=torch.zeros((rows, width_r), dtype=torch.long),
                       group_ids=["g"] * rows, raw_prompts=[messages] * rows)
    for row, response in enumerate(responses):
        ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
        out.prompt_ids[row, 2:], out.prompt_mask[row, 2:] = torch.as_tensor(prompt_ids), 1
        out.response_ids[row, :len(ids)], out.response_mask[row, :len(ids)] = torch.as_tensor(ids), 1
    return out


def test_same_vocabulary_reuses_the_policy_ids(char_tokenizer):
    batch = _rollout(char_tokenizer, "what is 2+3?", ["5", "the answer is 5"])
    rm_batch, metrics = RewardModelInputs(char_tokenizer, char_tokenizer).build(batch)
    assert metrics["reward/rm/retokenized"] == 0.0
    for row in range(2):
        assert rm_batch.input_ids[row][rm_batch.attention_mask[row].bool()].tolist() == \
            batch.input_ids[row][batch.attention_mask[row].bool()].tolist()


def test_max_length_drops_tokens_from_the_start(char_tokenizer):
    batch = _rollout(char_tokenizer, "what is 2+3?", ["the answer is 5"])
    whole = batch.input_ids[0][batch.attention_mask[0].bool()].tolist()
    rm_batch, metrics = RewardModelInputs(char_tokenizer, char_tokenizer, max_length=10).build(batch)
    assert rm_batch.input_ids[0][rm_batch.attention_mask[0].bool()].tolist() == whole[-10:]
    assert metrics["reward/rm/truncated"] == 1.0
    # shorter than the response: the first kept token becomes the reward model's one-token prompt
    rm_batch, _ = RewardModelInputs(char_tokenizer, char_tokenizer, max_length=3).build(batch)
    assert rm_batch.input_ids[0][rm_batch.attention_mask[0].bool()].tolist() == whole[-3:]
    assert int(rm_batch.prompt_mask.sum()) == 1 and int(rm_batch.response_mask.sum()) == 2


def test_another_vocabulary_is_decoded_and_retokenized(char_tokenizer, word_tokenizer):
    batch = _rollout(char_tokenizer, "what is 2+3?", ["5", "the answer"])
    rm_batch, metrics = RewardModelInputs(char_tokenizer, word_tokenizer).build(batch)
    assert metrics["reward/rm/retokenized"] == 1.0
    vocab = word_tokenizer.get_vocab()
    # no chat template: prompt text, newline, response text; the special end token dropped by decoding
    assert rm_batch.input_ids[0][rm_batch.attention_mask[0].bool()].tolist() == [vocab[w] for w in ("what", "is", "2+3?", "5")]
    assert rm_batch.response_ids[1][rm_batch.response_mask[1].bool()].tolist() == [vocab["the"], vocab["answer"]]
    assert rm_batch.prompt_ids[1][rm_batch.prompt_mask[1].bool()].tolist() == [vocab[w] for w in ("what", "is", "2+3?")]


def test_forced_retokenization_renders_the_reward_models_chat_template(char_tokenizer):
    batch = _rollout(char_tokenizer, "what is 2+3?", ["5"])
    rm_batch, _ = RewardModelInputs(char_tokenizer, char_tokenizer, retokenize=True).build(batch)
    text = char_tokenizer.decode(rm_batch.input_ids[0][rm_batch.attention_mask[0].bool()].tolist())
    assert text == "<|im_start|>user\nwhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    assert char_tokenizer.decode(rm_batch.response_ids[0][rm_batch.response_mask[0].bool()].tolist()) == "5<|im_end|>\n"


def test_combine_weights_normalises_then_clips_the_reward_model():
    rm = torch.tensor([1.0, 3.0, 5.0, 7.0])
    functions = torch.tensor([1.0, 0.0, 0.0, 1.0])
    total, metrics = combine_scores(rm_scores=rm, function_scores=functions, judge_scores=None, rm_weight=2.0,
                                    function_weight=0.5, judge_weight=1.0, normalize=True, clip=1.0)
    whitened = (rm - 4.0) / rm.std(unbiased=False)  # -1.34, -0.45, 0.45, 1.34
    expected = 2.0 * whitened.clamp(-1, 1) + 0.5 * functions
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-5)
    assert metrics["reward/rm/clip_fraction"] == 0.5 and metrics["reward/rm/raw_mean"] == 4.0
    assert metrics["reward/function/mean"] == 0.5
    with pytest.raises(ValueError, match="no reward source"):
        combine_scores(rm_scores=None, function_scores=None, judge_scores=None, rm_weight=1, function_weight=1,
                       judge_weight=1, normalize=False, clip=None)


def test_judge_prompts_fill_the_template_and_keep_the_end(char_tokenizer):
    template = "q: {question} r: {response} ref: {reference}"
    prompts, cut = judge_prompt_ids(char_tokenizer, template, questions=["what is 2+3?"], responses=["5"],
                                    references=["5"], max_prompt_tokens=1000)
    assert cut == 0
    assert char_tokenizer.decode(prompts[0]) == \
        "<|im_start|>user\nq: what is 2+3? r: 5 ref: 5<|im_end|>\n<|im_start|>assistant\n"
    short, cut = judge_prompt_ids(char_tokenizer, template, questions=["what is 2+3?"], responses=["5"],
                                  references=["5"], max_prompt_tokens=12)
    assert cut == 1 and short[0] == prompts[0][-12:]
    assert question_of([{"role": "system", "content": "s"}, {"role": "user", "content": "u1"},
                        {"role": "assistant", "content": "a"}, {"role": "user", "content": "u2"}]) == "u2"


def test_judgements_parse_to_scaled_scores_and_unparsable_ones_follow_the_policy():
    pattern = r"[Ss]core\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    scores, metrics = parse_judgements(["Score: 7", "score=10 then Score: 2", "no idea", "SCORE: 3"],
                                       pattern=pattern, scale=0.1, on_unparsable="zero")
    torch.testing.assert_close(scores, torch.tensor([0.7, 1.0, 0.0, 0.0]))
    assert metrics["reward/judge/unparsable"] == 2.0
    with pytest.raises(JudgeError, match=r"judgement 1 has no score .*'nothing here'"):
        parse_judgements(["Score: 1", "nothing here"], pattern=pattern, scale=1.0, on_unparsable="fail")


@pytest.mark.parametrize("overrides, message", [
    (["reward_model.enable=true"], r"reward_model.enable=true needs reward_model.model.path"),
    (["reward_model.enable=true", "reward_model.model.path=x", "trainer.backend=inprocess"],
     r"needs trainer.backend=ray"),
    (["reward_model.enable=true", "reward_model.model.path=x", "reward_model.enable_resource_pool=true"],
     r"reward_model.nnodes must be > 0"),
    (["reward_model.enable=true", "reward_model.model.path=x", "reward_model.megatron.tensor_model_parallel_size=2"],
     r"not divisible by reward_model.megatron.tensor_model_parallel_size"),
    (["reward_model.enable=true", "reward_model.model.path=x", "reward_model.remote.url=http://127.0.0.1:1"],
     r"reward_model.remote.url is set but reward_model.function_weight=0"),
    (["reward_model.judge.enable=true", "reward_model.judge.score_pattern=Score=\\d+"],
     r"reward_model.judge.score_pattern needs a group"),
    (["reward_model.judge.enable=true", "reward_model.judge.prompt_template=rate {answer}"],
     r"reward_model.judge.prompt_template: only \{question\}"),
    (["reward_model.judge.enable=true", "reward_model.judge.on_unparsable=skip"],
     r"reward_model.judge.on_unparsable='skip' is not one of"),
    (["reward_model.model.pth=x"], r"unknown config key 'reward_model.model.pth' \(did you mean 'path'\?\)"),
])
def test_reward_model_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/grpo_tiny.yaml", overrides=overrides)
