"""The agent loop's turns, masks, limits and scheduling, driven by scripted turns (the engines generating
for real: tests/distributed/agents/test_agent_rollout.py). Every expected sequence is written out token by token."""

import threading
import time

import pytest
import yaml
from transformers import AutoTokenizer

from megarl.agents.loop import AgentLoop, AgentSettings, TurnOutput, conversation_metrics
from megarl.agents.tool_parser import HermesToolParser, build_tool_parser
from megarl.agents.tools import Tool, load_tools, truncate_text
from megarl.data.tokenizer import ALPHABET, write_local_tokenizer

CONTEXT = "\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"  # the local ChatML template's tool turn


class Recorder(Tool):
    """Echoes its text after ``seconds`` of sleep; counts its calls."""
    calls: list = []

    def call(self, arguments):
        Recorder.calls.append(dict(arguments))
        time.sleep(float(arguments.get("seconds", 0)))
        return f"echo {arguments.get('text', '')}"


class Gate(Tool):
    """Holds its conversation until ``opened`` is set (by a test's script), at most 60 s; says which it was."""
    opened = threading.Event()

    def call(self, arguments):
        return "opened" if Gate.opened.wait(60) else "timed out"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(str(write_local_tokenizer(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def tools(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.yaml"
    echo = {"class_name": f"{__name__}.Recorder", "tool_schema": {"type": "function", "function": {
        "name": "echo", "parameters": {"type": "object", "properties": {"text": {}, "seconds": {}}}}}}
    calculator = {"class_name": "megarl.agents.builtin_tools.Calculator", "tool_schema": {"type": "function",
                  "function": {"name": "calculator", "parameters": {"type": "object", "properties": {
                      "expression": {}}, "required": ["expression"]}}}}
    gate = {"class_name": f"{__name__}.Gate", "tool_schema": {"type": "function", "function": {
        "name": "gate", "parameters": {"type": "object", "properties": {}}}}}
    path.write_text(yaml.safe_dump({"tools": [echo, calculator, gate]}))
    return load_tools(path)


def call(name, **arguments):
    import json
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class Script:
    """Turn generator: conversation ``k`` (its prompt is ``[k]``) says ``turns[k][i]`` in its turn ``i``, ending
    with the end-of-turn token unless the text ends in ``|stop`` (a stop string: no end-of-turn token).
    Records every wave: (time, which conversations, max_tokens, the prompts)."""

    def __init__(self, tokenizer, turns: dict[int, list[str]], log_prob=-0.5):
        self.tokenizer, self.turns, self.log_prob = tokenizer, turns, log_prob
        self.said = {k: 0 for k in turns}
        self.waves = []

    def __call__(self, prompts, max_tokens, keys):
        self.keys = getattr(self, "keys", []) + [keys]
        self.waves.append((time.monotonic(), [p[0] for p in prompts], max_tokens, [list(p) for p in prompts]))
        outputs = []
        for prompt in prompts:
            k = prompt[0]
            text = self.turns[k][self.said[k]]
            self.said[k] += 1
            ids = self.ids(text)
            finish = "stop"
            if len(ids) > max_tokens:
                ids, finish = ids[:max_tokens], "length"
            outputs.append(TurnOutput(ids, [self.log_prob] * len(ids), finish))
        return outputs

    def ids(self, text):
        if text.endswith("|stop"):
            return self.tokenizer.encode(text[:-5], add_special_tokens=False)
        return self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]


def make_loop(tokenizer, tools, **settings):
    return AgentLoop(tokenizer, tools, HermesToolParser(), AgentSettings(**{"max_response_length": 400, **settings}))


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_tool_result_enters_the_sequence_masked_and_the_next_turn_is_generated_after_it(tokenizer, tools):
    first, answer = call("calculator", expression="2+3"), "the answer is 5"
    script = Script(tokenizer, {7: [first, answer]})
    loop = make_loop(tokenizer, tools)
    (conversation,) = loop.run([[7, 8, 9]], script)
    turn1, turn2 = script.ids(first), script.ids(answer)
    context = encode(tokenizer, CONTEXT.format("5"))
    trajectory = conversation.trajectory
    assert trajectory.response_ids == turn1 + context + turn2
    assert trajectory.loss_mask == [1] * len(turn1) + [0] * len(context) + [1] * len(turn2)
    assert trajectory.log_probs == [-0.5] * len(turn1) + [0.0] * len(context) + [-0.5] * len(turn2)
    assert script.waves[1][3] == [[7, 8, 9] + turn1 + context]  # the second turn saw the calculator's "5"
    assert script.keys == [[(0, 0)], [(0, 1)]]  # (conversation, turn): what the turn's seed is made of
    summary = conversation.summary()
    assert summary["turns"] == 2 and summary["tool_calls"] == 1 and summary["tool_errors"] == 0
    assert summary["finish_reason"] == "stop" and summary["final_text"] == answer
    assert summary["calls"] == [{"name": "calculator", "arguments": {"expression": "2+3"}, "result": "5",
                                 "error": False}]
    assert summary["turn_tokens"] == [len(turn1), len(turn2)]


def test_the_budget_counts_every_turn_and_a_cut_call_is_not_run(tokenizer, tools):
    Recorder.calls.clear()
    first, second = call("echo", text="a"), call("echo", text="b")
    script = Script(tokenizer, {1: [first, second]})
    turn1 = script.ids(first)
    context = encode(tokenizer, CONTEXT.format("echo a"))
    budget = len(turn1) + len(context) + 10  # the second call does not fit
    (conversation,) = make_loop(tokenizer, tools, max_response_length=budget).run([[1]], script)
    trajectory = conversation.trajectory
    assert len(trajectory.response_ids) == budget and trajectory.finish_reason == "length"
    assert trajectory.response_ids[-10:] == script.ids(second)[:10] and trajectory.loss_mask[-10:] == [1] * 10
    assert Recorder.calls == [{"text": "a"}]  # the cut call never ran
    assert script.waves[1][2] == 10  # the second turn was asked for no more than what was left


def test_turn_limits_end_conversations_that_keep_calling(tokenizer, tools):
    calling = {1: [call("echo", text=str(i)) for i in range(5)]}
    (by_assistant,) = make_loop(tokenizer, tools, max_assistant_turns=2).run([[1]], Script(tokenizer, calling))
    assert by_assistant.trajectory.turns == 2 and by_assistant.trajectory.finish_reason == "max_turns"
    assert len(by_assistant.calls) == 1  # the second turn's call is not run: there is no turn to read it
    (by_user,) = make_loop(tokenizer, tools, max_user_turns=3).run([[1]], Script(tokenizer, calling))
    assert by_user.trajectory.turns == 4 and len(by_user.calls) == 3 and by_user.trajectory.finish_reason == "max_turns"


def test_extra_calls_and_malformed_calls_become_errors_the_model_reads(tokenizer, tools):
    turn = call("echo", text="x") + call("echo", text="y") + "<tool_call>{not json}</tool_call>"
    script = Script(tokenizer, {1: [turn, "done"]})
    (conversation,) = make_loop(tokenizer, tools, max_parallel_calls=1).run([[1]], script)
    results = [c["result"] for c in conversation.summary()["calls"]]
    assert results[0].startswith("Error: tool call is not valid JSON")
    assert results[1] == "echo x"
    assert results[2] == "Error: not run: at most 1 tool call(s) per turn are run"
    assert conversation.summary()["tool_errors"] == 2
    second_prompt = tokenizer.decode(script.waves[1][3][0])
    for result in results:  # every one of them went to the model (as far as the tiny alphabet spells it)
        assert "".join(ch for ch in result if ch in ALPHABET) in second_prompt


def test_a_turn_ended_by_a_stop_string_gets_its_end_of_turn_token_as_context(tokenizer, tools):
    first = call("echo", text="s") + "|stop"
    script = Script(tokenizer, {1: [first, "ok"]})
    (conversation,) = make_loop(tokenizer, tools).run([[1]], script)
    turn1 = script.ids(first)
    context = [tokenizer.eos_token_id] + encode(tokenizer, CONTEXT.format("echo s"))
    assert conversation.trajectory.response_ids == turn1 + context + script.ids("ok")
    assert conversation.trajectory.loss_mask[len(turn1):len(turn1) + len(context)] == [0] * len(context)


def test_max_tokens_per_turn_caps_each_turn_and_the_calls_it_completed_still_run(tokenizer, tools):
    first = call("echo", text="t") + " and then some more words"
    cap = len(encode(tokenizer, call("echo", text="t"))) + 3
    script = Script(tokenizer, {1: [first, "an answer " * 10]})
    (conversation,) = make_loop(tokenizer, tools, max_tokens_per_turn=cap).run([[1]], script)
    assert [w[2] for w in script.waves] == [cap, cap]
    assert conversation.summary()["calls"][0]["result"] == "echo t"
    assert conversation.trajectory.finish_reason == "length"  # the answer was cut by the cap: no stop
    assert conversation.summary()["turn_tokens"] == [cap, cap]


def test_a_slow_tool_holds_back_only_its_own_conversation(tokenizer, tools):
    """Conversation 1's tool returns only once conversation 2 has gone through its three tool rounds and answered
    (the script opens the gate then): a loop that waited for every tool before generating again would hold
    conversation 1's tool until it timed out. No wall-clock bound, so a loaded machine cannot fail it."""
    turns = {1: [call("gate"), "late"],
             2: [call("echo", text="a"), call("echo", text="b"), call("echo", text="c"), "quick"]}

    class OpensWhenTwoHasAnswered(Script):
        def __call__(self, prompts, max_tokens, keys):
            outputs = super().__call__(prompts, max_tokens, keys)
            if self.said[2] == len(turns[2]):
                Gate.opened.set()
            return outputs

    Gate.opened.clear()
    script = OpensWhenTwoHasAnswered(tokenizer, turns)
    conversations = make_loop(tokenizer, tools).run([[1], [2]], script)
    assert conversations[0].summary()["calls"][0]["result"] == "opened"
    assert [who for _, who, _, _ in script.waves] == [[1, 2], [2], [2], [2], [1]]
    assert script.keys == [[(0, 0), (1, 0)], [(1, 1)], [(1, 2)], [(1, 3)], [(0, 1)]]
    assert [c.trajectory.finish_reason for c in conversations] == ["stop", "stop"]
    assert conversations[1].final_text == "quick" and conversations[0].final_text == "late"


def test_conversations_finishing_their_tools_together_share_a_wave(tokenizer, tools):
    script = Script(tokenizer, {k: [call("echo", text=str(k)), "end"] for k in range(1, 9)})
    make_loop(tokenizer, tools).run([[k] for k in range(1, 9)], script)
    assert [sorted(who) for _, who, _, _ in script.waves] == [list(range(1, 9))] * 2


def test_conversation_metrics():
    summaries = [{"turns": 2, "tool_calls": 1, "tool_errors": 1, "tool_seconds": 0.5, "finish_reason": "stop",
                  "turn_tokens": [3, 5], "calls": [{"error": True}]},
                 {"turns": 1, "tool_calls": 0, "tool_errors": 0, "tool_seconds": 0.0, "finish_reason": "length",
                  "turn_tokens": [8], "calls": []}]
    metrics = conversation_metrics(summaries)
    assert metrics["agent/turns/mean"] == 1.5 and metrics["agent/turns/max"] == 2
    assert metrics["agent/tool_calls/mean"] == 0.5 and metrics["agent/tool_error_ratio"] == 1.0
    assert metrics["agent/tool_seconds_per_call"] == 0.5 and metrics["agent/tokens_per_turn/mean"] == 16 / 3
    assert metrics["agent/finish_stop"] == 0.5 and metrics["agent/finish_length"] == 0.5
    assert metrics["agent/finish_max_turns"] == 0.0


def test_truncate_text_keeps_the_side_asked_for():
    text = "".join(str(i % 10) for i in range(100))
    assert truncate_text(text, 100) == text
    assert truncate_text(text, 10, "left") == text[:10] + "\n... [90 characters cut]"
    assert truncate_text(text, 10, "right") == "[90 characters cut] ...\n" + text[-10:]
    middle = truncate_text(text, 12, "middle")
    assert middle.startswith(text[:9]) and middle.endswith(text[-3:]) and "[88 characters cut]" in middle
    with pytest.raises(ValueError, match="truncate side"):
        truncate_text(text, 10, "top")


def test_tool_call_parser_by_name_or_class():
    assert isinstance(build_tool_parser("hermes"), HermesToolParser)
    assert isinstance(build_tool_parser("megarl.agents.tool_parser.HermesToolParser"), HermesToolParser)
    with pytest.raises(ValueError, match="multi_turn.format='nowhere.Parser'"):
        build_tool_parser("nowhere.Parser")


def test_tools_run_on_threads_of_their_own(tokenizer, tools):
    seen = set()

    class Spy(Recorder):
        def call(self, arguments):
            seen.add(threading.current_thread().name)
            return "ok"

    spy_tools = {"echo": Spy(tools["echo"].schema)}
    make_loop(tokenizer, spy_tools).run([[1]], Script(tokenizer, {1: [call("echo", text="x"), "end"]}))
    assert seen and threading.current_thread().name not in seen
