"""The agent loop: many multi-turn, tool-calling conversations at once, over any turn generator.

Each conversation is one :class:`~megarl.agents.trajectory.Trajectory`: generate a turn -> parse its tool
calls -> run the tools -> append their results (as ``tool`` messages, through the chat template) -> generate
again, until a turn calls no tool (``stop``), ``max_assistant_turns`` / ``max_user_turns`` (``max_turns``) or
the response budget, which counts every turn (``length``).

Scheduling: the conversations whose next turn can be generated go to the engine together, in one call (a
*wave*); their tool calls run on a thread pool meanwhile. A slow tool holds back only its own conversation:
the loop waits for the first tool call to finish (and for the others finishing within ``gather_window_s``, so
waves stay large) and generates for those, while slower calls go on running. The engine is a function
``generate(prompts, max_tokens, keys) -> [TurnOutput]`` (one output per prompt, in order), so this module needs
no engine, and the trainer plugs in its rollout workers (:mod:`megarl.trainer.agent_rollout`). Which
conversations share a wave depends on tool timing; each turn is keyed by (conversation, turn) so the generator
can seed it by that key alone, and a run samples the same whatever the timing.

Conversations in one wave can have different budgets left; the wave is generated with the largest and each
turn is cut to its own budget (:meth:`Trajectory.add_generated`); a turn cut by the budget ends its
conversation (a cut tool call is not run), one cut by ``max_tokens_per_turn`` runs the calls it completed.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Callable, Optional

from megarl.agents.tool_parser import ParsedMessage, ToolCallParser
from megarl.agents.tools import Tool, run_tool
from megarl.agents.trajectory import Trajectory, context_tokens


@dataclass
class TurnOutput:
    token_ids: list[int]
    log_probs: Optional[list[float]]
    finish_reason: str  # stop | length
    routed_experts: Optional[object] = None  # MoE: the engine's [positions, L_moe, K] from routed_experts_start
    routed_experts_start: int = 0


# generate(prompts, max_tokens, keys) -> one output per prompt, in order; keys[i] = (conversation, turn) says
# whose turn prompt i is (a generator seeds each turn by it, so batching does not change what is sampled)
GenerateTurns = Callable[[list[list[int]], int, list[tuple[int, int]]], list[TurnOutput]]


@dataclass
class AgentSettings:
    max_response_length: int  # tokens of the whole response: every turn and every tool result
    max_assistant_turns: Optional[int] = None
    max_user_turns: Optional[int] = None  # rounds of tool results
    max_tokens_per_turn: Optional[int] = None  # one turn's share of the budget at most
    max_parallel_calls: int = 1
    tool_timeout_s: float = 30.0
    max_tool_response_length: int = 256  # characters
    tool_response_truncate_side: str = "middle"
    tool_workers: int = 32
    gather_window_s: float = 0.05


@dataclass
class ToolCallRecord:
    name: str
    arguments: dict
    result: str
    error: bool
    seconds: float


@dataclass
class Conversation:
    trajectory: Trajectory
    calls: list[ToolCallRecord] = field(default_factory=list)
    tool_rounds: int = 0
    turn_tokens: list[int] = field(default_factory=list)  # generated tokens per assistant turn
    final_text: str = ""  # the last assistant turn, without its tool-call blocks

    def summary(self) -> dict:
        """What rewards and metrics see of the conversation (put in each row's ``extra_info["agent"]``)."""
        return {"turns": self.trajectory.turns, "tool_calls": len(self.calls),
                "tool_errors": sum(call.error for call in self.calls),
                "tool_seconds": sum(call.seconds for call in self.calls),
                "finish_reason": self.trajectory.finish_reason, "final_text": self.final_text,
                "turn_tokens": list(self.turn_tokens),
                "calls": [{"name": c.name, "arguments": c.arguments, "result": c.result, "error": c.error}
                          for c in self.calls]}


# The template context after a turn is rendered against this short history, not the whole conversation: in
# the chat templates we know what follows an assistant turn depends only on that turn and the new messages,
# and re-rendering whole conversations every turn would cost O(turns^2).
_PLACEHOLDER_QUESTION = {"role": "user", "content": "?"}


class AgentLoop:
    def __init__(self, tokenizer, tools: dict[str, Tool], parser: ToolCallParser, settings: AgentSettings):
        self.tokenizer, self.tools, self.parser, self.settings = tokenizer, tools, parser, settings
        self.schemas = [tool.schema for tool in tools.values()]
        self._pool = concurrent.futures.ThreadPoolExecutor(settings.tool_workers, thread_name_prefix="megarl-agent")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, prompts: list[list[int]], generate: GenerateTurns) -> list[Conversation]:
        """One conversation per prompt (in order), each run to its end."""
        s = self.settings
        conversations = [Conversation(Trajectory(list(p), s.max_response_length)) for p in prompts]
        ready = list(conversations)
        index = {id(c): i for i, c in enumerate(conversations)}
        running: dict[concurrent.futures.Future, tuple[Conversation, str]] = {}
        while ready or running:
            if ready:
                budget = max(c.trajectory.budget for c in ready)
                if s.max_tokens_per_turn is not None:
                    budget = min(budget, s.max_tokens_per_turn)
                keys = [(index[id(c)], c.trajectory.turns) for c in ready]
                outputs = generate([c.trajectory.next_prompt() for c in ready], budget, keys)
                if len(outputs) != len(ready):
                    raise RuntimeError(f"the turn generator returned {len(outputs)} outputs for {len(ready)} prompts")
                for conversation, output in zip(ready, outputs):
                    parsed, text = self._take_turn(conversation, output)
                    if parsed is not None:
                        running[self._pool.submit(self._run_calls, parsed)] = (conversation, text)
                ready = []
            if running:
                done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
                later, _ = concurrent.futures.wait(set(running) - done, timeout=s.gather_window_s)
                for future in list(done) + list(later):
                    conversation, text = running.pop(future)
                    messages, records = future.result()
                    self._add_results(conversation, text, messages, records)
                    if not conversation.trajectory.finished:
                        ready.append(conversation)
        return conversations

    def _take_turn(self, conversation: Conversation, output: TurnOutput) -> tuple[Optional[ParsedMessage], str]:
        """Add a generated turn; the parsed tool calls to run, or None when the conversation ends here."""
        trajectory, s = conversation.trajectory, self.settings
        kept = min(len(output.token_ids), trajectory.budget)
        trajectory.add_generated(output.token_ids, output.log_probs)
        if output.routed_experts is not None:
            trajectory.add_routing(output.routed_experts, output.routed_experts_start)
        conversation.turn_tokens.append(kept)
        text = self.tokenizer.decode(output.token_ids[:kept], skip_special_tokens=True)
        parsed = self.parser.parse(text)
        conversation.final_text = parsed.text
        if trajectory.finished:  # the budget ended the turn (a cut tool call is not run)
            return None, text
        if not parsed.calls and not parsed.errors:  # an answer (or a turn cut by max_tokens_per_turn)
            trajectory.finish_reason = "stop" if output.finish_reason == "stop" else "length"
            return None, text
        if ((s.max_assistant_turns is not None and trajectory.turns >= s.max_assistant_turns)
                or (s.max_user_turns is not None and conversation.tool_rounds >= s.max_user_turns)):
            trajectory.finish_reason = "max_turns"
            return None, text
        return parsed, text

    def _run_calls(self, parsed: ParsedMessage) -> tuple[list[dict], list[ToolCallRecord]]:
        """On the pool: the turn's calls, one after another; every problem is a message for the model."""
        s = self.settings
        messages: list[dict] = []
        records: list[ToolCallRecord] = []

        def tell(name: str, arguments: dict, text: str, error: bool, seconds: float = 0.0) -> None:
            messages.append({"role": "tool", "name": name, "content": text})
            records.append(ToolCallRecord(name, arguments, text, error, seconds))

        for problem in parsed.errors:
            tell("", {}, f"Error: {problem}", True)
        for call in parsed.calls[: s.max_parallel_calls]:
            result = run_tool(self.tools, call.name, call.arguments, timeout_s=s.tool_timeout_s,
                              max_output_chars=s.max_tool_response_length,
                              truncate_side=s.tool_response_truncate_side)
            tell(call.name, call.arguments, result.text, result.error, result.seconds)
        for call in parsed.calls[s.max_parallel_calls:]:
            tell(call.name, call.arguments, f"Error: not run: at most {s.max_parallel_calls} tool call(s) per "
                                            f"turn are run", True)
        return messages, records

    def _add_results(self, conversation: Conversation, turn_text: str, messages: list[dict],
                     records: list[ToolCallRecord]) -> None:
        conversation.calls += records
        conversation.tool_rounds += 1
        history = [_PLACEHOLDER_QUESTION, {"role": "assistant", "content": turn_text}]
        context = context_tokens(self.tokenizer, history, messages, tools=self.schemas)
        trajectory = conversation.trajectory
        if trajectory.response_ids[-1] != self.tokenizer.eos_token_id:
            # the turn ended at a stop string or at max_tokens_per_turn: the template's end-of-turn token goes in
            context = [self.tokenizer.eos_token_id] + context
        trajectory.add_context(context)


def conversation_metrics(summaries: list[dict]) -> dict[str, float]:
    """``agent/*`` metrics of a batch's conversations (their :meth:`Conversation.summary`)."""
    if not summaries:
        return {}
    count = len(summaries)
    calls = [call for s in summaries for call in s["calls"]]
    turn_tokens = [tokens for s in summaries for tokens in s["turn_tokens"]]
    metrics = {
        "agent/turns/mean": sum(s["turns"] for s in summaries) / count,
        "agent/turns/max": float(max(s["turns"] for s in summaries)),
        "agent/tool_calls/mean": len(calls) / count,
        "agent/tool_errors/mean": sum(s["tool_errors"] for s in summaries) / count,
        "agent/tool_error_ratio": sum(c["error"] for c in calls) / max(len(calls), 1),
        "agent/tool_seconds_per_call": sum(s["tool_seconds"] for s in summaries) / max(len(calls), 1),
        "agent/tokens_per_turn/mean": sum(turn_tokens) / max(len(turn_tokens), 1),
    }
    for reason in ("stop", "length", "max_turns"):
        metrics[f"agent/finish_{reason}"] = sum(s["finish_reason"] == reason for s in summaries) / count
    return metrics
