"""vLLM's layerwise reload warns "<layer>: Failed to load weights" for rotary layers on every healthy weight sync
(their cos/sin cache is a buffer no checkpoint holds; vLLM keeps it): megarl hides that one, explains it once, and
lets the same warning for any other layer through (issue 37)."""

import logging

from megarl.engines.rollout.vllm_compat import quiet_expected_reload_warnings

LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _Collect(logging.Handler):
    """Records as the logger's own handlers get them (vLLM's loggers may not propagate to the root's)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_rotary_reload_warning_is_hidden_and_explained_once_and_others_show():
    quiet_expected_reload_warnings()
    quiet_expected_reload_warnings()  # idempotent: one filter
    layerwise, megarl = logging.getLogger(LOGGER), logging.getLogger("megarl")
    assert sum(type(f).__name__ == "_ExpectedReloadWarning" for f in layerwise.filters) == 1
    seen, explained = _Collect(), _Collect()
    layerwise.addHandler(seen)
    megarl.addHandler(explained)
    level = megarl.level
    megarl.setLevel(logging.INFO)
    try:
        for _ in range(3):
            layerwise.warning("%s: Failed to load weights", "RotaryEmbedding")
        layerwise.warning("%s: Failed to load weights", "QKVParallelLinear")
    finally:
        layerwise.removeHandler(seen)
        megarl.removeHandler(explained)
        megarl.setLevel(level)
    assert seen.messages == ["QKVParallelLinear: Failed to load weights"]  # a real failure still shows, alone
    assert sum("rotary cache is a buffer no checkpoint holds" in m for m in explained.messages) <= 1
