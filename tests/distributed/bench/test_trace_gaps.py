"""bench/trace_gaps.py on a hand-written trace: which gap is charged to which host code."""

import gzip
import json

from bench.trace_gaps import analyse, load_events, main


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def _trace():
    return [
        # host: an outer megarl function, inside it a loss function that syncs, then launches kernel 2 late
        _x("python_function", "megarl/engines/megatron/actor.py(100): update_policy", 0, 1000),
        _x("python_function", "megarl/algorithms/policy_loss.py(82): compute_ppo_clip_loss", 100, 400),
        _x("cuda_runtime", "cudaLaunchKernel", 10, 5, correlation=1),
        _x("cuda_runtime", "cudaStreamSynchronize", 120, 150),
        _x("cuda_runtime", "cudaLaunchKernel", 450, 5, correlation=2),
        _x("cuda_runtime", "cudaLaunchKernel", 460, 5, correlation=3),
        # device: kernel 1 [20, 260), idle until kernel 2 at 460 (host late: launched at 450 >= 260),
        # kernel 3 queued at 460 but starts at 800 after kernel 2 ends (no gap), then a device-side gap
        _x("kernel", "gemm", 20, 240, tid=7, correlation=1),
        _x("kernel", "softmax", 460, 340, tid=7, correlation=2),
        _x("kernel", "gemm2", 900, 100, tid=7, correlation=3),
    ]


def test_a_late_launch_is_charged_to_the_python_code_that_made_it_and_the_sync_is_counted(tmp_path):
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as handle:
        json.dump({"traceEvents": _trace()}, handle)
    result = analyse(load_events(str(path)), min_gap_us=20)
    assert result["busy_ms"] * 1e3 == 240 + 340 + 100
    assert result["span_ms"] * 1e3 == 1000 - 20
    (late,) = result["host_late"]
    assert late["site"].startswith("policy_loss.py:82 compute_ppo_clip_loss <- actor.py:100 update_policy")
    assert late["idle_ms"] * 1e3 == 460 - 260
    # kernel 3 was launched at 460, long before the 800-900 gap ended: the device, not the host, left it idle
    assert result["idle_ms_device_side"] * 1e3 == 100
    (wait,) = result["host_waits"]
    assert wait["site"].startswith("cudaStreamSynchronize @ policy_loss.py:82") and wait["calls"] == 1
    main([str(path), "--top", "3"])  # the command-line report runs on the same file
