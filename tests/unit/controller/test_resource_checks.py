"""Static cluster-resource checks and worker-env construction, against hand-written cluster descriptions."""

from __future__ import annotations

import pytest

from megarl.controller.ray_cluster import build_worker_env, megarl_source_root
from megarl.controller.resource_pool import ResourcePoolError, check_cluster_resources


def gpu_node(ip: str, gpus: int = 8, cpus: int = 64) -> dict:
    return {"node_id": ip, "ip": ip, "resources": {"GPU": float(gpus), "CPU": float(cpus)}}


def test_two_nodes_of_eight_gpus_do_not_fit_one_node():
    with pytest.raises(ResourcePoolError) as caught:
        check_cluster_resources("actor", [8, 8], device="cuda", cpus_per_process=1, gpus_per_process=1,
                                cluster=[gpu_node("10.0.0.1")])
    message = str(caught.value)
    assert "resource pool 'actor' asks for 2 nodes x 8 processes (1 GPU, 1 CPU per process)" in message
    assert "the cluster has 1 alive node: 10.0.0.1 (8 GPU, 64 CPU)" in message
    assert "pool node 1 (8 processes needing 8 GPU, 8 CPU on one machine) fits on no node" in message


def test_fitting_layouts_pass():
    cluster = [gpu_node("a"), gpu_node("b")]
    check_cluster_resources("p", [8, 8], device="cuda", cpus_per_process=1, gpus_per_process=1, cluster=cluster)
    # Largest first: 4 + 4 share a node, 8 takes the other.
    check_cluster_resources("p", [4, 8, 4], device="cuda", cpus_per_process=1, gpus_per_process=1, cluster=cluster)
    check_cluster_resources("p", [4], device="cpu", cpus_per_process=0.5, gpus_per_process=0,
                            cluster=[{"node_id": "c", "ip": "c", "resources": {"CPU": 2.0}}])


def test_pack_must_fit_on_one_node_even_if_totals_suffice():
    cluster = [gpu_node("a", gpus=4), gpu_node("b", gpus=4)]
    with pytest.raises(ResourcePoolError, match=r"pool node 0 \(8 processes needing 8 GPU"):
        check_cluster_resources("p", [8], device="cuda", cpus_per_process=1, gpus_per_process=1, cluster=cluster)


def test_cpu_shortage_and_no_gpu_cluster():
    cpu_only = [{"node_id": "c", "ip": "c", "resources": {"CPU": 2.0}}]
    with pytest.raises(ResourcePoolError, match="no GPUs"):
        check_cluster_resources("p", [1], device="cuda", cpus_per_process=1, gpus_per_process=1, cluster=cpu_only)
    with pytest.raises(ResourcePoolError, match=r"needing 4 CPU"):
        check_cluster_resources("p", [4], device="cpu", cpus_per_process=1, gpus_per_process=0, cluster=cpu_only)


def test_worker_env_precedence_forwarding_and_debug():
    environ = {"MEGARL_SEED": "3", "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1", "HOME": "/root",
               "CUDA_DEVICE_MAX_CONNECTIONS": "8", "PYTHONPATH": "/opt/x"}
    env = build_worker_env(environ=environ, extra_env={"NCCL_DEBUG": "WARN"}, extra_pythonpath=["/tmp"],
                           debug="legacy", debug_post_mortem=True)
    assert env["MEGARL_SEED"] == "3" and env["NCCL_DEBUG"] == "WARN" and env["NCCL_NVLS_ENABLE"] == "0"
    assert "CUDA_VISIBLE_DEVICES" not in env and "HOME" not in env
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # only the driver's MEGARL_/NCCL_/... prefixes are forwarded
    assert env["PYTHONPATH"].split(":") == [megarl_source_root(), "/tmp", "/opt/x"]
    assert env["RAY_DEBUG"] == "legacy" and env["RAY_DEBUG_POST_MORTEM"] == "1"
    assert build_worker_env(environ={"MEGARL_RAY_DEBUG": "debugpy"})["RAY_DEBUG"] == "1"
    assert "RAY_DEBUG" not in build_worker_env(environ={})
    with pytest.raises(ValueError, match="MEGARL_RAY_DEBUG"):
        build_worker_env(environ={"MEGARL_RAY_DEBUG": "yes"})
