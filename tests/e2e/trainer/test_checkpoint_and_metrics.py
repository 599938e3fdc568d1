"""Checkpoint directory protocol and metric backends (real TensorBoard event files)."""

import io
import json
from pathlib import Path

import pytest

from megarl.trainer.checkpoint import MARKER, CheckpointManager
from megarl.trainer.metrics import MetricsLogger, read_jsonl_metrics, timed


def test_interrupted_save_is_never_latest(tmp_path):
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    staging = manager.begin(10)
    (staging / "actor").mkdir()
    manager.commit(10, staging, {"step": 10})
    assert manager.latest_step() == 10

    # A save of step 20 that dies after the engines wrote their parts but before commit.
    crashed = manager.begin(20)
    (crashed / "actor").mkdir()
    assert manager.latest_step() == 10
    assert manager.finished_steps() == [10]

    # The next save of the same step starts clean and then becomes latest.
    staging = manager.begin(20)
    assert not (staging / "actor").exists()
    manager.commit(20, staging, {"step": 20})
    manager.commit(30, manager.begin(30), {"step": 30})
    assert manager.latest_step() == 30
    assert manager.finished_steps() == [20, 30]  # pruned to max_to_keep
    assert manager.load_trainer_state(30) == {"step": 30}


def test_marker_pointing_at_missing_checkpoint_is_an_error(tmp_path):
    (tmp_path / MARKER).write_text("7")
    with pytest.raises(FileNotFoundError, match="names step 7"):
        CheckpointManager(tmp_path).latest_step()
    (tmp_path / MARKER).write_text("garbage")
    with pytest.raises(ValueError, match="expected a step number"):
        CheckpointManager(tmp_path).latest_step()


def test_metrics_reach_console_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    console = io.StringIO()
    logger = MetricsLogger(["console", "tensorboard", "jsonl"], tmp_path, stream=console)
    for step in (1, 2):
        metrics = {"critic/score/mean": 0.25 * step, "actor/entropy": 1.5}
        with timed("step", metrics):
            pass
        logger.log(metrics, step)
    logger.close()

    assert "critic/score/mean=0.5" in console.getvalue()
    assert "step_time_s=" in console.getvalue() and " step=" not in console.getvalue()  # labelled, not a step number
    rows = read_jsonl_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["critic/score/mean"] == 0.5
    assert rows[0]["timing_s/step"] >= 0
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("critic/score/mean")
    assert [(s.step, s.value) for s in scalars] == [(1, 0.25), (2, 0.5)]
    json.dumps(rows)  # plain floats only


def test_resume_forgets_rows_past_the_checkpoint_and_a_cut_last_line(tmp_path):
    from megarl.trainer.metrics import MetricsLogger, read_jsonl_metrics

    logger = MetricsLogger(["jsonl"], tmp_path)
    for step in (1, 2, 3):
        logger.log({"x": step}, step=step)
    logger._jsonl.write('{"step": 4, "x"')  # a kill in the middle of a line
    logger.forget_after(2)
    logger.log({"x": 3.5}, step=3)
    logger.close()
    assert [(r["step"], r["x"]) for r in read_jsonl_metrics(tmp_path / "metrics.jsonl")] == [(1, 1), (2, 2), (3, 3.5)]


@pytest.fixture
def small_disk(tmp_path):
    """A 7 MB tmpfs: room for one tiny-model checkpoint (~4.5 MB), not two. Needs root (CI runs as root)."""
    import subprocess

    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=7m", "tmpfs", str(mount_point)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.timeout(300)
def test_a_full_disk_is_said_in_words_and_loses_nothing(small_disk):
    from megarl.run_config import load_config
    from megarl.trainer.checkpoint import CheckpointManager
    from megarl.trainer.main import run

    out = small_disk / "run"
    cfg = load_config(Path(__file__).resolve().parents[3] / "configs" / "grpo_tiny.yaml", [
        "trainer.backend=inprocess", "trainer.total_training_steps=3", "trainer.save_freq=1", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.logger=['jsonl']",
        f"trainer.default_local_dir={out}"])
    with pytest.raises(OSError, match=r"checkpoint of step 2 could not be written: the disk holding .*small/run/"
                                      r"checkpoints is full \([\d,]+ bytes free; .*step 1 is the last complete "
                                      r"checkpoint, untouched") as info:
        run(cfg)
    assert info.value.errno == 28  # ENOSPC
    print(info.value)
    checkpoints = CheckpointManager(out / "checkpoints")
    assert checkpoints.latest_step() == 1 and checkpoints.load_trainer_state(1)["step"] == 1
    assert not list((out / "checkpoints").glob("*.partial"))  # the failed write gave its space back


def test_the_command_line_gives_data_errors_one_line_and_files_the_traceback(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megarl.trainer.main import cli

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "data_source": pa.array([], pa.string()),
                             "reward_model": pa.array([], pa.struct([("ground_truth", pa.string())]))}), empty)
    out = tmp_path / "run"
    code = cli(["--config", str(Path(__file__).resolve().parents[3] / "configs" / "grpo_tiny.yaml"),
                f"data.train_files=['{empty}']", f"trainer.default_local_dir={out}", "trainer.backend=inprocess"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[0].startswith("error: ValueError: no rows in ") and "empty.parquet" in err[0], err
    assert err[1] == f"(full traceback: {out / 'error.log'})" and len(err) == 2, err
    assert "Traceback (most recent call last)" in (out / "error.log").read_text()


def test_a_second_run_on_the_same_directory_names_the_first(tmp_path):
    import os
    import subprocess
    import sys

    from megarl.trainer.run_lock import RunDirectoryInUse, RunLock

    # the first run: another process holding the lock
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from megarl.trainer.run_lock import RunLock;"
                               f" lock = RunLock({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryInUse, match=rf"is in use by pid {holder.pid} on .* since"):
            RunLock(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    RunLock(tmp_path).release()  # a killed holder leaves the file, not the lock
    assert os.path.exists(tmp_path / ".lock")


def test_a_checkpoint_missing_a_roles_state_is_never_committed(tmp_path):
    """Workers that wrote their shards elsewhere (a relative output path resolved in another directory) leave the
    staging directory without the role's state: the commit refuses, and the previous checkpoint stays latest."""
    manager = CheckpointManager(tmp_path / "checkpoints")
    staging = manager.begin(1)
    (staging / "actor").mkdir()
    (staging / "actor" / "latest").write_text("0\n")
    manager.commit(1, staging, {"step": 1}, roles=("actor",))
    staging = manager.begin(2)
    (staging / "actor").mkdir()  # no 'latest': the engine never finished writing here
    with pytest.raises(RuntimeError, match=r"checkpoint of step 2 not committed: .*actor holds no complete actor "
                                           r"state.*same path as the driver"):
        manager.commit(2, staging, {"step": 2}, roles=("actor", "critic"))
    assert manager.latest_step() == 1
