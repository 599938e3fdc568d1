"""Multi-turn, tool-calling generation behind the rollout facade's own interface.

:class:`AgentRollout` has :class:`~megarl.controller.roles.Rollout`'s ``generate`` / ``generate_async``, so the
loop, validation and one-step-off generation use it unchanged; each of its responses is a whole conversation
run by :class:`~megarl.agents.loop.AgentLoop` on the rollout workers (every wave of turns is one ``generate``
call over the ranks), returned as an :class:`AgentOutput`: the response tokens, the rollout log-probs (0 on
tool results), which tokens the model generated, and a summary of the conversation for rewards and metrics.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megarl.agents.loop import AgentLoop, AgentSettings, TurnOutput
from megarl.agents.tool_parser import build_tool_parser
from megarl.config.schema import MegarlConfig
from megarl.engines.rollout.base import RolloutOutput, SamplingConfig

# Turn t of conversation c samples with seed + c * _TURN_SEEDS + t: the same whichever wave it lands in (that
# depends on tool timing), so a run, and a resumed run, sample every turn the same.
_TURN_SEEDS = 1_009


@dataclass
class AgentOutput(RolloutOutput):
    loss_mask: list[int] = field(default_factory=list)  # 1 on the tokens the model generated
    agent: dict = field(default_factory=dict)  # Conversation.summary()


class AgentRollout:
    def __init__(self, rollout, loop: AgentLoop):
        self.rollout, self.loop = rollout, loop
        self._background = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="megarl-agent-rollout")

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig,
                 multi_modal_inputs: Optional[list[Optional[dict]]] = None) -> list[AgentOutput]:
        """``sampling.n`` conversations per prompt; ``sampling.max_tokens`` is each conversation's budget. A
        prompt's images (``multi_modal_inputs``, a vision-language model's) go with every turn of its
        conversations: their tokens stay where the prompt put them, tools answer in text."""
        rows = [index for index in range(len(prompts)) for _ in range(sampling.n)]

        def turns(turn_prompts: list[list[int]], max_tokens: int, keys: list[tuple[int, int]]) -> list[TurnOutput]:
            seeds = () if sampling.seed is None else tuple(
                sampling.seed + conversation * _TURN_SEEDS + turn for conversation, turn in keys)
            images = None
            if multi_modal_inputs:
                images = [multi_modal_inputs[rows[conversation]] for conversation, _ in keys]
            outputs = self.rollout.generate(turn_prompts, dataclasses.replace(
                sampling, n=1, max_tokens=max_tokens, prompt_seeds=seeds), images)
            by_prompt = sorted(outputs, key=lambda out: out.prompt_index)
            return [TurnOutput(out.token_ids, out.log_probs, out.finish_reason, out.routed_experts,
                               out.routed_experts_start) for out in by_prompt]

        conversations = self.loop.run([prompts[index] for index in rows], turns)
        return [AgentOutput(prompt_index=index, token_ids=c.trajectory.response_ids,
                            log_probs=c.trajectory.log_probs if sampling.logprobs else None,
                            finish_reason="length" if c.trajectory.finish_reason == "length" else "stop",
                            loss_mask=c.trajectory.loss_mask, agent=c.summary(),
                            routed_experts=c.trajectory.routed_experts)
                for index, c in zip(rows, conversations)]

    def generate_async(self, prompts: list[list[int]], sampling: SamplingConfig,
                       multi_modal_inputs: Optional[list[Optional[dict]]] = None) -> concurrent.futures.Future:
        """:meth:`generate` on a thread of its own; ``.result()`` waits for it."""
        return self._background.submit(self.generate, prompts, sampling, multi_modal_inputs)

    def close(self) -> None:
        self._background.shutdown(wait=True)
        self.loop.close()


def build_agent_rollout(cfg: MegarlConfig, rollout, tokenizer, tools: dict) -> AgentRollout:
    """``rollout`` running ``actor_rollout_ref.rollout.multi_turn``'s conversations with ``tools``
    (:func:`megarl.agents.tools.load_tools` of its tools file)."""
    m = cfg.actor_rollout_ref.rollout.multi_turn
    settings = AgentSettings(
        max_response_length=cfg.data.max_response_length, max_assistant_turns=m.max_assistant_turns,
        max_user_turns=m.max_user_turns, max_tokens_per_turn=m.max_tokens_per_turn,
        max_parallel_calls=m.max_parallel_calls, tool_timeout_s=m.tool_timeout_s,
        max_tool_response_length=m.max_tool_response_length, tool_response_truncate_side=m.tool_response_truncate_side,
        tool_workers=m.tool_workers)
    return AgentRollout(rollout, AgentLoop(tokenizer, tools, build_tool_parser(m.format), settings))
