"""Experiment trackers behind ``trainer.logger``: ``wandb``, ``mlflow`` and ``swanlab``, beside the console,
TensorBoard and JSONL loggers of megarl.trainer.metrics. Each is an optional package (``pip install
'megarl[trackers]'``); one asked for and not installed is refused at start-up (:func:`check_trackers_installed`),
before any worker starts.

Where each writes, as verl's users set it, through the tracker's own variables:

* wandb: ``WANDB_MODE=offline`` (a run directory under ``<default_local_dir>/wandb``, ``wandb sync`` later) or
  online with ``WANDB_API_KEY``; project ``trainer.project_name``, run name ``trainer.experiment_name``.
* mlflow: ``MLFLOW_TRACKING_URI`` (a server, or ``sqlite:///path.db``); without it, a SQLite store in the run
  directory (``<default_local_dir>/mlflow.db``, artifacts beside it). Experiment = project, run name = experiment.
  Metric names keep the characters mlflow allows; others become ``_``.
* swanlab: ``SWANLAB_MODE`` (``offline`` writes ``<default_local_dir>/swanlog``; ``cloud`` with
  ``SWANLAB_API_KEY``).

A resumed run continues the same tracker run: the run ids live in ``<default_local_dir>/trackers.json``. Steps
trained again after a resume are logged again (mlflow and swanlab keep both values, the later last, as
TensorBoard does; wandb keeps the first, since its steps only go forward).
Tables (rollout traces, validation generations): a ``wandb.Table``, an mlflow JSON artifact per step
(``<name>/step_<n>.json``), a ``swanlab.Text`` per row.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from pathlib import Path
from typing import Any, Protocol

from megarl.checkpoint_io.files import write_json_atomically
from megarl.config.errors import ConfigError
from megarl.config.loader import flatten_dotted

TRACKERS = ("wandb", "mlflow", "swanlab")
_PACKAGES = {"wandb": ("wandb",), "mlflow": ("mlflow", "sqlalchemy", "alembic"), "swanlab": ("swanlab",)}
RUN_IDS_FILE = "trackers.json"


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_table(self, name: str, rows: list[dict], step: int) -> None: ...

    def close(self) -> None: ...


def check_trackers_installed(loggers: list[str]) -> None:
    """Every tracker named in ``trainer.logger`` importable, or one error naming each missing package."""
    missing = [f"{name} (needs {', '.join(p for p in _PACKAGES[name] if importlib.util.find_spec(p) is None)})"
               for name in loggers if name in _PACKAGES
               and any(importlib.util.find_spec(p) is None for p in _PACKAGES[name])]
    if missing:
        raise ConfigError(f"trainer.logger asks for {', '.join(missing)}, not installed here: "
                          f"pip install 'megarl[trackers]' (or drop them from trainer.logger)")


class _RunIds:
    """``trackers.json``: which tracker run this output directory belongs to, so a resume continues it (a run
    that starts afresh in the same directory opens new tracker runs and records those)."""

    def __init__(self, log_dir: Path, *, resuming: bool):
        self.path = log_dir / RUN_IDS_FILE
        self.ids = json.loads(self.path.read_text()) if resuming and self.path.is_file() else {}

    def get(self, tracker: str) -> str | None:
        return self.ids.get(tracker)

    def put(self, tracker: str, run_id: str) -> None:
        self.ids[tracker] = run_id
        write_json_atomically(self.path, self.ids)


def _cell(value: Any) -> Any:
    """A table cell a tracker shows as it is (numbers, booleans, empty) or as text."""
    return value if value is None or isinstance(value, (int, float, bool)) else str(value)


def _columns(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [c for c in row if c not in columns]
    return columns


class WandbTracker:
    def __init__(self, *, project: str, experiment: str, config: dict, log_dir: Path, run_ids: _RunIds):
        import wandb

        self._wandb = wandb
        run_id = run_ids.get("wandb")
        self.run = wandb.init(project=project, name=experiment, config=config, dir=str(log_dir),
                              id=run_id, resume="allow" if run_id else None)
        run_ids.put("wandb", self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        columns = _columns(rows)
        data = [[_cell(row.get(column)) for column in columns] for row in rows]
        self.run.log({name: self._wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD_CHARS = re.compile(r"[^\w\-. /]")


class MlflowTracker:
    """Through an ``MlflowClient`` of its own (no process-wide active run to leak into other code)."""

    def __init__(self, *, project: str, experiment: str, config: dict, log_dir: Path, run_ids: _RunIds):
        from mlflow import MlflowClient
        from mlflow.entities import Param

        log_dir.mkdir(parents=True, exist_ok=True)
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(log_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        known = self.client.get_experiment_by_name(project)
        experiment_id = known.experiment_id if known else self.client.create_experiment(
            project, artifact_location=None if "MLFLOW_TRACKING_URI" in os.environ
            else (log_dir / "mlflow_artifacts").resolve().as_uri())
        run_id = run_ids.get("mlflow")
        if run_id is None:
            run_id = self.client.create_run(experiment_id, run_name=experiment).info.run_id
            params = [Param(key, str(value)[:6000]) for key, value in flatten_dotted(config).items()]
            for start in range(0, len(params), 100):  # mlflow's batch limit
                self.client.log_batch(run_id, params=params[start:start + 100])
            run_ids.put("mlflow", run_id)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(_MLFLOW_BAD_CHARS.sub("_", key), value, now, step) for key, value in metrics.items()]
        for start in range(0, len(entries), 1000):  # mlflow's batch limit
            self.client.log_batch(self.run_id, metrics=entries[start:start + 1000])

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        self.client.log_dict(self.run_id, {"step": step, "rows": json.loads(json.dumps(rows, default=str))},
                             f"{_MLFLOW_BAD_CHARS.sub('_', name)}/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class SwanlabTracker:
    def __init__(self, *, project: str, experiment: str, config: dict, log_dir: Path, run_ids: _RunIds):
        import swanlab

        self._swanlab = swanlab
        run_id = run_ids.get("swanlab")
        self.run = swanlab.init(project=project, name=experiment, config=config, log_dir=str(log_dir / "swanlog"),
                                id=run_id, resume="allow" if run_id else None, reinit=True)
        run_ids.put("swanlab", self.run.id)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        text = [self._swanlab.Text(json.dumps(row, default=str)) for row in rows]
        self.run.log({name: text}, step=step)

    def close(self) -> None:
        self.run.finish()


_TRACKER_CLASSES = {"wandb": WandbTracker, "mlflow": MlflowTracker, "swanlab": SwanlabTracker}


def open_trackers(loggers: list[str], *, project: str, experiment: str | None, config: dict, log_dir: Path,
                  resuming: bool) -> list[Tracker]:
    """One open tracker run per tracker named in ``loggers`` (others are megarl.trainer.metrics' own); when
    ``resuming``, the runs this directory's earlier steps went to."""
    check_trackers_installed(loggers)
    log_dir.mkdir(parents=True, exist_ok=True)
    run_ids = _RunIds(log_dir, resuming=resuming)
    name = experiment or log_dir.name
    return [_TRACKER_CLASSES[logger](project=project, experiment=name, config=config, log_dir=log_dir,
                                     run_ids=run_ids) for logger in loggers if logger in _TRACKER_CLASSES]
