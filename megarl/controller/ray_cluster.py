"""Start a local Ray cluster or attach to a running one, with the environment every megarl worker needs.

`init_ray()` starts a local cluster (tests, single box); `init_ray(address="auto")` or `"host:port"` attaches to
one started by `ray start` (multi-node, see `launch/`). Workers get, through the job's runtime_env:

- PYTHONPATH with the directory holding the `megarl` package (plus `extra_pythonpath`), so worker classes are
  importable by reference on every node (assumes the same checkout path on all nodes, e.g. a shared FS);
- the driver's MEGARL_*, NCCL_*, GLOO_*, TORCH_*, PYTORCH_*, HF_*, TRANSFORMERS_*, VLLM_* variables;
- defaults that Megatron/NCCL want on GPU: CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's TP/SP comm-compute
  overlap relies on in-order kernel launch), NCCL_NVLS_ENABLE=0 (NVLink SHARP buffers cost GPU memory and
  break under some container setups), TOKENIZERS_PARALLELISM=false (tokenizer threads fork badly).
  A forwarded driver variable (e.g. NCCL_NVLS_ENABLE=1) wins over these defaults; `extra_env` wins over both.

Debugging worker code: Ray routes `breakpoint()` inside actors to its own debugger (it sets PYTHONBREAKPOINT
in every worker). Turn it on with MEGARL_RAY_DEBUG on the driver, or Ray's own RAY_DEBUG (and
RAY_DEBUG_POST_MORTEM), which the driver forwards to the workers (Ray's defaults do not reach the workers of a
`ray start` cluster); `init_ray(debug=...)` wins over both:

- "debugpy" (RAY_DEBUG=1): the worker prints "Ray debugger is listening on <ip>:<port>" and waits for a DAP
  client: VS Code's "Ray Distributed Debugger" extension (it finds breakpoints through the Ray dashboard, which
  a cluster megarl starts then runs, at the address printed), or any DAP client attached to that port.
  Needs debugpy on the workers (`pip install -e '.[debug]'`).
- "legacy" (RAY_DEBUG=legacy): pdb over a socket; run `ray debug --address <gcs>` in a shell on the head node,
  pick the breakpoint, and you get a pdb prompt in the worker (with several ranks, each rank's breakpoint).
- `debug_post_mortem=True` (RAY_DEBUG_POST_MORTEM=1) drops into the debugger when a worker method raises.

While a rank sits at a breakpoint, its call's watchdog waits and the collectives of its peers do not time out
(megarl.controller.debugging). `MEGARL_BREAK_AT=<method>[:<rank>]` stops before a worker method without editing
code. When no address is given and a cluster is already running on this machine (`ray start --head`), the
driver attaches to it instead of failing on Ray's "num_cpus ... must not be provided" (RAY_ADDRESS=local: start
a private one).
Leaves out: cluster launching (`launch/`, `slurm/`) and resource pools (`resource_pool.py`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import ray

from megarl.controller.debugging import debugging_on
from megarl.controller.orphan_reaper import start_orphan_reaper, stop_orphan_reaper

DEFAULT_WORKER_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
FORWARDED_ENV_PREFIXES = ("MEGARL_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "HF_", "TRANSFORMERS_", "VLLM_")
# Ray assigns GPUs per actor by setting CUDA_VISIBLE_DEVICES; forwarding the driver's value would fight it.
NEVER_FORWARDED = frozenset({"CUDA_VISIBLE_DEVICES"})
DEBUG_MODES = {"off": None, "debugpy": "1", "legacy": "legacy"}
DEBUG_ENV = "MEGARL_RAY_DEBUG"


def megarl_source_root() -> str:
    """Directory that contains the `megarl` package (what workers need on PYTHONPATH)."""
    return str(Path(__file__).resolve().parents[2])


def debug_mode(debug: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """"off", "debugpy" or "legacy": ``debug`` if given, else MEGARL_RAY_DEBUG, else Ray's own RAY_DEBUG
    ("1" debugpy, "legacy"; "0" off) as the person set it on the driver."""
    source = os.environ if environ is None else environ
    if debug is not None:
        mode, origin = debug, "debug="
    elif source.get(DEBUG_ENV):
        mode, origin = source[DEBUG_ENV], DEBUG_ENV
    else:
        ray_value = source.get("RAY_DEBUG", "0")
        mode = {"0": "off", "1": "debugpy", "legacy": "legacy"}.get(ray_value, ray_value)
        origin = "RAY_DEBUG"
    if mode not in DEBUG_MODES:
        raise ValueError(f"debug mode {mode!r} (from {origin}) is not one of {sorted(DEBUG_MODES)}")
    return mode


def running_cluster_address() -> str | None:
    """The Ray cluster Ray itself would attach to with no address (RAY_ADDRESS, else the last `ray start` on this
    machine, if it still runs), or None."""
    from ray._private.services import canonicalize_bootstrap_address

    try:
        return canonicalize_bootstrap_address(None)
    except (ConnectionError, ValueError):  # a stale `ray start` record: nothing to attach to
        return None


def build_worker_env(
    *,
    extra_env: Mapping[str, str] | None = None,
    extra_pythonpath: Sequence[str] = (),
    debug: str | None = None,
    debug_post_mortem: bool = False,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Return the env_vars every worker process of the job gets (see the module docstring for precedence)."""
    source = os.environ if environ is None else environ
    env = dict(DEFAULT_WORKER_ENV)
    for name, value in source.items():
        if name.startswith(FORWARDED_ENV_PREFIXES) and name not in NEVER_FORWARDED:
            env[name] = value
    mode = debug_mode(debug, source)
    if DEBUG_MODES[mode] is not None:
        env["RAY_DEBUG"] = DEBUG_MODES[mode]
    if debug_post_mortem or source.get("RAY_DEBUG_POST_MORTEM") == "1":
        env["RAY_DEBUG_POST_MORTEM"] = "1"
    paths = [megarl_source_root(), *[str(Path(p).resolve()) for p in extra_pythonpath]]
    if source.get("PYTHONPATH"):
        paths.extend(source["PYTHONPATH"].split(os.pathsep))
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    if extra_env:
        env.update({name: str(value) for name, value in extra_env.items()})
    return env


def init_ray(
    address: str | None = None,
    *,
    num_cpus: float | None = None,
    num_gpus: int | None = None,
    extra_env: Mapping[str, str] | None = None,
    extra_pythonpath: Sequence[str] = (),
    debug: str | None = None,
    debug_post_mortem: bool = False,
    runtime_env: Mapping[str, Any] | None = None,
    **ray_init_kwargs: Any,
) -> dict[str, str]:
    """Start (address=None) or attach to (address="auto" / "host:port") a Ray cluster; return the worker env.

    `num_cpus`/`num_gpus` only apply to a local cluster: an existing cluster's resources were fixed by
    `ray start`. `runtime_env` entries other than env_vars are passed through (e.g. a conda env);
    its env_vars override ours. Other keyword arguments go to `ray.init` unchanged.
    """
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; call shutdown_ray() first")
    if address is not None and (num_cpus is not None or num_gpus is not None):
        raise ValueError(f"num_cpus/num_gpus cannot be set when attaching to an existing cluster "
                         f"(address={address!r}); they are fixed by `ray start` on each node")
    worker_env = build_worker_env(extra_env=extra_env, extra_pythonpath=extra_pythonpath, debug=debug,
                                  debug_post_mortem=debug_post_mortem)
    merged_runtime_env = dict(runtime_env or {})
    worker_env.update(merged_runtime_env.pop("env_vars", {}) or {})
    merged_runtime_env["env_vars"] = worker_env
    debugging = debugging_on(worker_env)
    ray_init_kwargs.setdefault("include_dashboard", debugging)  # VS Code's Ray debugger finds breakpoints there
    context = ray.init(address=address, num_cpus=num_cpus, num_gpus=num_gpus, runtime_env=merged_runtime_env,
                       **ray_init_kwargs)
    if debugging:
        print(f"[megarl] worker debugging on (RAY_DEBUG={worker_env['RAY_DEBUG']}); Ray dashboard: "
              f"{getattr(context, 'dashboard_url', None) or 'none on this cluster'}", flush=True)
    if address is None:  # this process owns the cluster: nothing of it may outlive a SIGKILL of this process
        start_orphan_reaper()
    return worker_env


def shutdown_ray() -> None:
    """Disconnect from (and, for a local cluster, stop) Ray; a no-op when Ray is not initialised."""
    if ray.is_initialized():
        ray.shutdown()
    stop_orphan_reaper()


def describe_cluster() -> list[dict[str, Any]]:
    """Alive nodes as dicts {node_id, ip, resources}; used by resource checks and placement tables."""
    return [
        {"node_id": node["NodeID"], "ip": node["NodeManagerAddress"], "resources": dict(node["Resources"])}
        for node in ray.nodes()
        if node.get("Alive", False)
    ]
