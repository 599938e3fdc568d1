"""Worker debugging's decisions on plain inputs: which debugger a driver's variables ask for, what reaches the
workers, where MEGARL_BREAK_AT stops, and when a stack dump shows a rank stopped in a debugger (the real thing,
attached with a DAP client: tests/e2e/trainer/test_worker_debugger.py)."""

import pytest

from megarl.controller.debugging import (DEBUG_COLLECTIVE_TIMEOUT_S, break_requested, collective_timeout_s,
                                         reason_to_wait_on, sits_at_breakpoint)
from megarl.controller.ray_cluster import build_worker_env, debug_mode


@pytest.mark.parametrize("environ,mode", [
    ({}, "off"), ({"RAY_DEBUG": "0"}, "off"), ({"RAY_DEBUG": "1"}, "debugpy"), ({"RAY_DEBUG": "legacy"}, "legacy"),
    ({"MEGARL_RAY_DEBUG": "legacy", "RAY_DEBUG": "1"}, "legacy"),  # megarl's variable wins over Ray's
])
def test_the_debugger_asked_for_by_the_drivers_variables(environ, mode):
    assert debug_mode(None, environ) == mode
    env = build_worker_env(environ=environ)
    assert env.get("RAY_DEBUG") == {"off": None, "debugpy": "1", "legacy": "legacy"}[mode]


def test_a_debug_mode_ray_does_not_know_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match="from RAY_DEBUG"):
        debug_mode(None, {"RAY_DEBUG": "yes"})
    assert debug_mode("off", {"RAY_DEBUG": "1"}) == "off"  # init_ray(debug=...) wins over both


def test_post_mortem_from_rays_own_variable_reaches_the_workers():
    assert build_worker_env(environ={"RAY_DEBUG_POST_MORTEM": "1"})["RAY_DEBUG_POST_MORTEM"] == "1"
    assert "RAY_DEBUG_POST_MORTEM" not in build_worker_env(environ={})


def test_break_at_a_method_on_every_rank_or_on_one():
    assert break_requested("update_actor", 3, {"MEGARL_BREAK_AT": "update_actor"})
    assert break_requested("update_actor", 1, {"MEGARL_BREAK_AT": "update_actor:1"})
    assert not break_requested("update_actor", 0, {"MEGARL_BREAK_AT": "update_actor:1"})
    assert not break_requested("generate", 0, {"MEGARL_BREAK_AT": "update_actor"})
    assert not break_requested("generate", 0, {})
    with pytest.raises(ValueError, match="MEGARL_BREAK_AT"):
        break_requested("update_actor", 0, {"MEGARL_BREAK_AT": "update_actor:first"})


def _dump(*threads: list[str]) -> str:
    blocks = []
    for index, frames in enumerate(threads):
        blocks.append(f"Thread 0x{index:016x} (most recent call first):\n" +
                      "\n".join(f'  File "{path}", line 1 in f' for path in frames))
    return "\n\n".join(blocks)


MAIN_BOTTOM = ["/site-packages/ray/_private/worker.py", "/site-packages/ray/_private/workers/default_worker.py"]
PYDEVD_THREAD = ["/debugpy/_vendored/pydevd/_pydevd_bundle/pydevd_comm.py", "/usr/lib/python3.12/threading.py"]


def test_a_rank_stopped_in_the_debugger_is_told_from_a_hung_one():
    at_breakpoint = _dump(["/debugpy/_vendored/pydevd/pydevd.py", "/work/megarl/controller/worker_group.py",
                           *MAIN_BOTTOM], PYDEVD_THREAD)
    waiting_for_client = _dump(["/site-packages/ray/util/debugpy.py", "/work/megarl/controller/worker_group.py",
                                *MAIN_BOTTOM])
    # continued: debugpy's own threads stay in pydevd's frames, the main thread is stuck in a collective
    hung = _dump(["/site-packages/torch/distributed/distributed_c10d.py", *MAIN_BOTTOM], PYDEVD_THREAD)
    assert sits_at_breakpoint(at_breakpoint) and sits_at_breakpoint(waiting_for_client)
    assert not sits_at_breakpoint(hung) and not sits_at_breakpoint("")


def test_the_watchdog_waits_on_a_paused_rank_and_on_an_unread_one_only_while_debugging():
    paused = _dump(["/debugpy/_vendored/pydevd/pydevd.py", *MAIN_BOTTOM])
    hung = _dump(["/site-packages/torch/distributed/distributed_c10d.py", *MAIN_BOTTOM])
    unread = "(could not dump stacks: GetTimeoutError: timed out)"
    assert reason_to_wait_on({0: hung, 1: paused}, [], {0: False, 1: False}) == \
        "rank(s) [1] sit at a debugger breakpoint"
    assert reason_to_wait_on({0: hung, 1: unread}, [1], {0: True, 1: True}) == \
        "the stacks of rank(s) [1] could not be read and debugging is on"
    assert reason_to_wait_on({0: hung, 1: unread}, [1], {0: False, 1: False}) is None  # a hang, reported
    assert reason_to_wait_on({0: hung}, [], {0: True}) is None  # read and not in a debugger: a hang even so


def test_collectives_wait_a_day_only_while_debugging():
    assert collective_timeout_s(600.0, {}) == 600.0
    assert collective_timeout_s(600.0, {"RAY_DEBUG": "1"}) == DEBUG_COLLECTIVE_TIMEOUT_S
