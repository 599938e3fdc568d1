"""vLLM's layerwise reload warns "<layer>: Failed to load weights" for rotary layers on every healthy weight sync
(their cos/sin cache is a buffer no checkpoint holds; vLLM keeps it): megarl hides that one, explains it once, and
lets the same warning for any other layer through (issue 37)."""

import logging

from megarl.engines.rollout.vllm_compat import quiet_expected_reload_warnings

LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def test_the_rotary_reload_warning_is_hidden_and_explained_once_and_others_show(caplog):
    quiet_expected_reload_warnings()
    quiet_expected_reload_warnings()  # idempotent: one filter
    layerwise = logging.getLogger(LOGGER)
    assert sum(type(f).__name__ == "_ExpectedReloadWarning" for f in layerwise.filters) == 1
    with caplog.at_level(logging.INFO):
        for _ in range(3):
            layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")
    messages = [r.getMessage() for r in caplog.records]
    assert "QKVParallelLinear: Failed to load weights" in messages  # a real failure still shows
    assert not any(m == "RotaryEmbedding: Failed to load weights" for m in messages)
    assert sum("rotary cache is a buffer no checkpoint holds" in m for m in messages) <= 1
