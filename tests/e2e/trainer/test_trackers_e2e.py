"""trainer.logger's experiment trackers for real: wandb (offline run directory), mlflow (SQLite store, read back
through mlflow's own client) and swanlab (offline), in a tiny in-process run that is stopped and resumed. Each
tracker is read back from what it wrote and compared with metrics.jsonl, step by step."""

from __future__ import annotations

import glob
import json
import math
import struct
from pathlib import Path

import pytest

from megarl.run_config import load_config
from megarl.trainer.metrics import read_jsonl_metrics
from tests.paths import REPO

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("swanlab")

TRACKERS = ("wandb", "mlflow", "swanlab")


def _leveldb_records(path: str) -> list[bytes]:
    """The records of a LevelDB-log file (wandb's and swanlab's run files): 7-byte file header, 32 KiB blocks,
    each record a 7-byte header (crc32, length, kind: 1 full, 2 first, 3 middle, 4 last) and its bytes."""
    data, block, pos = Path(path).read_bytes(), 32768, 7
    records, pending = [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding at the end of a block
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records


def wandb_history(log_dir: Path) -> dict[int, dict]:
    """step -> logged values, over every offline run file of this run directory (a resume appends one)."""
    from wandb.proto import wandb_internal_pb2

    history: dict[int, dict] = {}
    for path in sorted(glob.glob(str(log_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        for raw in _leveldb_records(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                history.setdefault(int(items["_step"]), {}).update(items)
    return history


def swanlab_scalars(log_dir: Path) -> dict[int, dict]:
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record

    scalars: dict[int, dict] = {}
    for path in sorted(glob.glob(str(log_dir / "swanlog" / "run-*" / "*.swanlab"))):
        for raw in _leveldb_records(path):
            record = Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "scalar":
                scalars.setdefault(record.scalar.step, {})[record.scalar.key] = record.scalar.value.number
    return scalars


def _run(tmp_path: Path, steps: int):
    from megarl.trainer.main import run

    return run(load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"trainer.default_local_dir={tmp_path}", "trainer.progress_bar=false", "trainer.val_before_train=false",
        "trainer.backend=inprocess", f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
        "trainer.test_freq=2", "data.val_batch_size=16", "trainer.log_val_generations=2",
        "trainer.project_name=megarl_ci", "trainer.experiment_name=trackers",
        "trainer.logger=[console,jsonl,wandb,mlflow,swanlab]"]))


@pytest.mark.timeout(600)
def test_every_tracker_holds_what_the_run_logged_across_a_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("SWANLAB_MODE", "offline")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _run(tmp_path, steps=2)
    first_ids = json.loads((tmp_path / "trackers.json").read_text())
    assert set(first_ids) == set(TRACKERS)
    _run(tmp_path, steps=3)  # resumes from step 2's checkpoint into the same tracker runs
    assert json.loads((tmp_path / "trackers.json").read_text()) == first_ids

    logged = {row["step"]: row for row in read_jsonl_metrics(tmp_path / "metrics.jsonl")}
    assert sorted(logged) == [1, 2, 3]
    keys = [k for k in logged[1] if k != "step" and not k.startswith("timing_s/")] + ["timing_s/step"]

    def same(a: float, b: float) -> bool:
        return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-12)

    # wandb: every offline run file of the run id, one history row per step with every key
    history = wandb_history(tmp_path)
    assert {p.rsplit("-", 1)[-1] for p in glob.glob(str(tmp_path / "wandb" / "offline-run-*"))} == {first_ids["wandb"]}
    for step, row in logged.items():
        assert all(same(history[step][k], row[k]) for k in keys), step
    assert history[2]["val_generations/_type"] == "table-file" and history[2]["val_generations/nrows"] == 2
    table_file = tmp_path / "wandb" / f"offline-run-*" / "files" / history[2]["val_generations/path"]
    table = json.loads(Path(glob.glob(str(table_file))[0]).read_text())
    assert table["columns"][:3] == ["input", "output", "score"] and len(table["data"]) == 2

    # mlflow: one run, read through mlflow's own client
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = client.get_run(first_ids["mlflow"])
    assert run.info.run_name == "trackers" and run.info.status == "FINISHED"
    assert run.data.params["actor_rollout_ref.rollout.n"] == "8"
    for key in keys:
        values = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
        assert sorted(values) == [1, 2, 3] and all(same(values[s], logged[s][key]) for s in logged), key
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "val_generations/step_000002.json",
                                                      str(tmp_path / "dl"))).read_text())
    assert table["step"] == 2 and len(table["rows"]) == 2 and {"input", "output", "score"} <= set(table["rows"][0])

    # swanlab: its offline record file(s)
    scalars = swanlab_scalars(tmp_path)
    for step, row in logged.items():
        assert all(same(scalars[step][k], row[k]) for k in keys), step


def test_a_tracker_that_is_not_installed_is_named_before_anything_starts(tmp_path, monkeypatch):
    import importlib.util

    from megarl.config.errors import ConfigError
    from megarl.trainer.main import run

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "swanlab" else real_find_spec(name, *a))
    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[console,swanlab]"])
    with pytest.raises(ConfigError, match=r"trainer.logger asks for swanlab \(needs swanlab\).*megarl\[trackers\]"):
        run(cfg)
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched


def test_a_fresh_start_in_the_same_directory_opens_new_tracker_runs(tmp_path, monkeypatch):
    """Only a resume continues the recorded tracker run; a run that starts afresh there (resume_mode=disable, or
    nothing to resume) must not pour its steps into the old one."""
    from megarl.trainer.trackers import open_trackers

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def run_id(resuming: bool) -> str:
        (tracker,) = open_trackers(["jsonl", "mlflow"], project="p", experiment="e", config={"a": {"b": 1}},
                                   log_dir=tmp_path, resuming=resuming)
        tracker.close()
        return tracker.run_id

    first = run_id(resuming=False)
    assert run_id(resuming=True) == first
    fresh = run_id(resuming=False)
    assert fresh != first and run_id(resuming=True) == fresh
