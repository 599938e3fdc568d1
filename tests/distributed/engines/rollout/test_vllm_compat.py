"""The vLLM version range is stated once (vllm_compat) and setup.py's extra names the same; the in-process
engine environment is scoped to the engine's construction."""

import os
import re
from pathlib import Path

from megarl.engines.rollout import vllm_compat


def test_setup_extra_names_the_tested_range():
    setup = (Path(__file__).resolve().parents[4] / "setup.py").read_text()
    extra = re.search(r'"vllm": \["vllm([^"]*)"\]', setup)
    assert extra and extra.group(1) == vllm_compat.SUPPORTED_VERSIONS


def test_in_process_engine_env_is_restored(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with vllm_compat.in_process_engine_env(0):
        assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["LOCAL_RANK"] == "0"
    assert os.environ["LOCAL_RANK"] == "3" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    with vllm_compat.in_process_engine_env(None):  # CPU: the launcher's LOCAL_RANK stays
        assert os.environ["LOCAL_RANK"] == "3"
