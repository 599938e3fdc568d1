"""Fixtures for rollout-engine tests: tiny Qwen2 model dirs; registers the `vllm` marker."""

from __future__ import annotations

import pytest

from tests.distributed.engines.rollout.tiny_model import build_tiny_qwen2


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs the vllm package; starts one real vLLM engine per session")
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped without one")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


@pytest.fixture(scope="session")
def tiny_tied_qwen2_dir(tmp_path_factory):
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_tied_qwen2"), seed=1, tie_word_embeddings=True)
