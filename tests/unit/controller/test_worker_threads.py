"""How many intra-op threads torch gets in a worker process (megarl/controller/worker_env.py): Ray starts every
actor with OMP_NUM_THREADS=1, which left a GPU worker's host Adam on one core of the node."""

from megarl.controller.worker_env import intra_op_threads, worker_env_for


def test_a_gpu_worker_gets_its_share_of_the_nodes_cores():
    assert intra_op_threads("cuda", local_world_size=1, cores=16) == 16  # the lent box: one GPU, 16 cores
    assert intra_op_threads("cuda", local_world_size=8, cores=128) == 16
    assert intra_op_threads("cuda", local_world_size=8, cores=4) == 1  # never 0


def test_a_cpu_worker_keeps_one_and_the_drivers_setting_wins(monkeypatch):
    assert intra_op_threads("cpu", local_world_size=2, cores=16) == 1
    assert intra_op_threads("cuda", local_world_size=1, cores=16, requested="4") == 4
    assert intra_op_threads("cpu", local_world_size=1, cores=16, requested="2") == 2
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert "MEGARL_WORKER_THREADS" not in worker_env_for("cuda")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert worker_env_for("cuda")["MEGARL_WORKER_THREADS"] == "3"
    assert worker_env_for("cpu")["OMP_NUM_THREADS"] == "3"
