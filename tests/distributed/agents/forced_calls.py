"""A tool-call parser for tests: a random-init policy never writes a ``<tool_call>`` block, so this parser
reads every turn that is not an answer (digits only) as a call to the calculator on ``<its length> * 7``.
The calculator really runs and its result really enters the conversation, and the test can compute what
it must read there from the generated text alone. Plugged in by ``multi_turn.format`` like any parser."""

from megarl.agents.tool_parser import ParsedMessage, ToolCall

DIGITS = set("0123456789")


def expected_result(turn_text: str) -> str:
    return str(len(turn_text) * 7)


class CalculatorEveryTurn:
    def parse(self, text: str) -> ParsedMessage:
        answer = text.strip()
        if answer and set(answer) <= DIGITS:
            return ParsedMessage(text=answer)
        return ParsedMessage(text=answer, calls=[ToolCall("calculator", {"expression": f"{len(text)} * 7"})])
