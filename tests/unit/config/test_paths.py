"""Relative paths are made absolute against the driver's directory before any worker sees the config."""

from pathlib import Path

from megarl.run_config import load_config
from megarl.config.paths import with_absolute_paths


def test_relative_paths_point_where_they_point_from_the_driver(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.parquet").touch()
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    cfg = load_config(overrides=[
        "trainer.default_local_dir=outputs/run", "data.train_files=['data/train.parquet']",
        "data.val_files=['embedded:digits']", "actor_rollout_ref.model.path=./models/qwen",
        "actor_rollout_ref.model.tokenizer_path=Qwen/Qwen2.5-7B-Instruct", "trainer.resume_mode=ckpts/global_step_3"])
    resolved = with_absolute_paths(cfg, tmp_path)
    assert resolved.trainer.default_local_dir == str(tmp_path / "outputs" / "run")
    assert resolved.data.train_files == [str(tmp_path / "data" / "train.parquet")]
    assert resolved.data.val_files == ["embedded:digits"]
    assert resolved.actor_rollout_ref.model.path == str(tmp_path / "models" / "qwen")
    assert resolved.actor_rollout_ref.model.tokenizer_path == "Qwen/Qwen2.5-7B-Instruct"  # may be a hub id
    assert resolved.trainer.resume_mode == str(tmp_path / "ckpts" / "global_step_3")
    assert cfg.trainer.default_local_dir == "outputs/run"  # the input is not changed
    assert Path(with_absolute_paths(resolved, "/elsewhere").trainer.default_local_dir) == tmp_path / "outputs" / "run"
