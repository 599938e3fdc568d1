"""slurm/grpo_7b.sh under real Slurm: a two-node allocation (two slurmd on this host, started by
``scripts/slurm_single_host.sh up``; CI does that), real sbatch/srun/scancel, real Ray on both nodes, the tiny
model on CPU with TP=2 over 2 x 2 worker processes.

One job's life across three submissions, sharing a checkpoint directory:

1. submitted from another directory by a relative path, with ``--export=NONE``: trains 2 steps on both nodes,
   checkpoints, ends COMPLETED; Ray on each node is stopped through Slurm (it drains; no "Killed", no forced
   termination), its temp dir is gone and no process of the job is left;
2. resubmitted: resumes at step 2, then gets the pre-timeout signal (``scancel --batch --signal=TERM``, what
   ``--signal=B:TERM@300`` sends): finishes its step, checkpoints, ends COMPLETED with exit 0;
3. resubmitted: resumes where 2 stopped, then ``scancel``: ends CANCELLED, its step's checkpoint written within
   Slurm's KillWait, nothing left on either node.

Skipped where no two-node Slurm answers (``MEGARL_REQUIRE_SLURM=1``, set by CI, turns that into a failure).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dist_harness import free_port
from tests.e2e.launch.test_slurm_sim import TINY_CONFIG, wait_until_gone
from tests.paths import REPO

JOB_TIMEOUT_S = 240


def two_node_slurm_answers() -> str:
    """'' when sinfo shows two idle nodes, else why not."""
    if shutil.which("sbatch") is None:
        return "no sbatch on PATH"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%D %t"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if out.stdout.strip() != "2 idle":
        return f"sinfo shows {out.stdout.strip() or out.stderr.strip()!r}, not '2 idle'"
    return ""


@pytest.fixture
def slurm(tmp_path):
    why_not = two_node_slurm_answers()
    if why_not:
        message = f"no two-node Slurm here ({why_not}); start one with: bash scripts/slurm_single_host.sh up"
        if os.environ.get("MEGARL_REQUIRE_SLURM") == "1":
            pytest.fail(message)
        pytest.skip(message)
    submitted: list[str] = []
    yield submitted
    for job in submitted:
        subprocess.run(["scancel", "--signal=KILL", job], capture_output=True)


def job_fields(job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def wait_for_job_end(job: str, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        fields = job_fields(job)
        if fields["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            return fields
        time.sleep(1)
    raise AssertionError(f"job {job} still {job_fields(job)['JobState']} after {timeout_s} s")


def wait_for_line(path: Path, pattern: str, job: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and re.search(pattern, path.read_text(errors="replace"), re.M):
            return
        state = job_fields(job)["JobState"]
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job} ended ({state}) before {pattern!r}:\n{tail(path)}")
        time.sleep(0.5)
    raise AssertionError(f"{path} did not show {pattern!r} within {timeout_s} s:\n{tail(path)}")


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no output)"


def latest_step(run_dir: Path) -> int:
    return int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())


def test_job_trains_on_two_nodes_resumes_and_stops_cleanly_on_every_signal(slurm, tmp_path):
    config = tmp_path / "tiny_cpu.yaml"
    config.write_text(TINY_CONFIG)
    run_dir, log_dir = tmp_path / "run", tmp_path / "logs"
    port = free_port()
    env_vars = {
        "PATH": os.environ["PATH"], "PYTHON": sys.executable, "MEGARL_SLURM_CONFIG": str(config),
        "MEGARL_SLURM_DEVICE": "cpu", "MEGARL_SLURM_GPUS_PER_NODE": "2", "MEGARL_RAY_PORT": str(port),
        "MEGARL_RAY_STOP_GRACE_S": "20", "LOG_DIR": str(log_dir),
    }
    markers = [f":{port}", str(log_dir)]
    elsewhere = tmp_path / "somewhere_else"
    elsewhere.mkdir()
    script = os.path.relpath(REPO / "slurm" / "grpo_7b.sh", elsewhere)

    def submit(name: str, *overrides: str, export_none: bool = False) -> tuple[str, Path]:
        output = tmp_path / f"{name}.out"
        export = ["--export=NONE," + ",".join(f"{k}={v}" for k, v in env_vars.items())] if export_none else []
        proc = subprocess.run(
            ["sbatch", "--parsable", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=2", f"--output={output}",
             *export, script, f"trainer.default_local_dir={run_dir}", "trainer.save_freq=2", *overrides],
            cwd=elsewhere, env={**os.environ, **env_vars}, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        job = proc.stdout.strip().split(";")[0]
        slurm.append(job)
        return job, output

    def assert_nothing_left(job: str, output: Path) -> None:
        text = output.read_text(errors="replace")
        assert "forcing job termination" not in text and "Killed" not in text, tail(output)
        for node in ("n1", "n2"):
            node_log = (log_dir / f"{node}.log").read_text(errors="replace")
            assert "finished draining" in node_log, node_log[-2000:]
        assert not Path(f"/tmp/ray_{job}").exists()
        assert wait_until_gone(markers, 30) == [], "processes of the job outlived it"

    # 1. two steps on both nodes, from another directory, with --export=NONE
    job, output = submit("first", "trainer.total_training_steps=2", export_none=True)
    fields = wait_for_job_end(job, JOB_TIMEOUT_S)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), tail(output)
    text = output.read_text(errors="replace")
    placement = text[text.index("placement ("):].splitlines()[1:6]
    assert {line.split()[-1] for line in placement[1:]} == {"n1", "n2"}, placement
    assert latest_step(run_dir) == 2
    assert (run_dir / "checkpoints" / "global_step_2" / "actor").is_dir()
    assert_nothing_left(job, output)

    # 2. resubmitted: resumes, then the pre-timeout signal ends it with a checkpoint and COMPLETED
    job, output = submit("second", "trainer.total_training_steps=40")
    wait_for_line(output, r"^step 4:", job, JOB_TIMEOUT_S)
    assert "resumed from" in output.read_text() and "at step 2" in output.read_text()
    subprocess.run(["scancel", "--batch", "--signal=TERM", job], check=True)
    fields = wait_for_job_end(job, JOB_TIMEOUT_S)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), tail(output)
    stopped_at = latest_step(run_dir)
    assert stopped_at >= 4 and f"stopped after step {stopped_at} of 40" in output.read_text(), tail(output)
    assert_nothing_left(job, output)

    # 3. resubmitted: resumes where 2 stopped; scancel ends it within KillWait, nothing left behind
    job, output = submit("third", "trainer.total_training_steps=40")
    wait_for_line(output, rf"^step {stopped_at + 1}:", job, JOB_TIMEOUT_S)
    assert f"at step {stopped_at}" in output.read_text()
    subprocess.run(["scancel", job], check=True)
    fields = wait_for_job_end(job, JOB_TIMEOUT_S)
    assert fields["JobState"] == "CANCELLED", tail(output)
    assert latest_step(run_dir) > stopped_at, tail(output)
    assert_nothing_left(job, output)
