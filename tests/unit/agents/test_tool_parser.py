"""Hermes/Qwen tool calls in generated text: calls, the text around them, and malformed blocks as errors."""

from megarl.agents.tool_parser import HermesToolParser, ToolCall

PARSER = HermesToolParser()


def test_calls_and_the_text_around_them():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    message = PARSER.parse(text)
    assert message.calls == [ToolCall("calculator", {"expression": "3*4"}), ToolCall("python", {"code": "print(1)"})]
    assert message.text == "Let me compute." and message.errors == []


def test_no_call_is_plain_text():
    message = PARSER.parse("The answer is 12.")
    assert message.calls == [] and message.errors == [] and message.text == "The answer is 12."


def test_malformed_blocks_are_errors_for_the_model_not_exceptions():
    message = PARSER.parse('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>'
                           '<tool_call>["calculator"]</tool_call>'
                           '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
                           '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}</tool_call>'
                           'then <tool_call>{"name": "python", "argu')
    assert message.calls == [ToolCall("calculator", {"expression": "1"})]
    assert len(message.errors) == 4
    assert "not valid JSON" in message.errors[0] and "string 'name'" in message.errors[1]
    assert "'arguments' must be a JSON object" in message.errors[2] and "unterminated" in message.errors[3]
    assert message.text == "then"
