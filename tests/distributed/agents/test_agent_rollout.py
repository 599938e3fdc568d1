"""The agent loop with a real rollout engine generating (the HF engine here, vLLM in
tests/distributed/engines/rollout/test_vllm_engine.py): the calculator really runs between turns and its result is what
the next turn was generated after."""

import pytest
from transformers import AutoTokenizer

from megarl.data.tokenizer import write_local_tokenizer
from megarl.engines.rollout.hf_engine import HFRolloutEngine
from tests.distributed.agents.conversation_checks import generate_and_check
from tests.distributed.engines.rollout.tiny_model import build_tiny_qwen2
from tests.paths import REPO


@pytest.mark.timeout(300)
def test_conversations_of_the_hf_engine_hold_the_tool_results_they_were_generated_after(tmp_path):
    engine = HFRolloutEngine(str(build_tiny_qwen2(tmp_path / "model", seed=0)))
    chat_tokenizer = AutoTokenizer.from_pretrained(str(write_local_tokenizer(tmp_path / "chat")))
    outputs = generate_and_check(engine, engine.model, chat_tokenizer,
                                 REPO / "configs" / "tools" / "calculator_python.yaml", atol=1e-4)
    assert any(o.agent["finish_reason"] == "max_turns" for o in outputs)
