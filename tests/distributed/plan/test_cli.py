"""`python -m megarl.plan`: straight from an HF config, and from the repository's big recipes."""

import subprocess
import sys

import pytest

from megarl.plan.__main__ import main
from tests.paths import REPO

REFERENCE = REPO / "megarl" / "models" / "reference_configs"


def test_hf_config_flags_fit_and_exit_zero(capsys):
    rc = main(["--hf-config", str(REFERENCE / "qwen2_5_7b_instruct"), "--world-size", "8", "--tp", "2",
               "--rollout-tp", "2", "--global-batch-size", "256", "--max-seq-len", "4096"])
    assert rc == 0
    assert capsys.readouterr().out.strip().endswith("FITS")


def test_recompute_grouping_flags_reach_the_plan(capsys):
    flags = ["--hf-config", str(REFERENCE / "qwen2_5_7b_instruct"), "--world-size", "1", "--global-batch-size",
             "64", "--max-seq-len", "4096", "--recompute", "full", "--gpu-memory-gib", "1000"]

    def actor_train_gib(*extra):
        import re

        assert main([*flags, *extra]) == 0
        return float(re.search(r"\[actor train\].*?actor activations +([\d.]+) GiB", capsys.readouterr().out,
                               re.DOTALL).group(1))

    full = actor_train_gib()
    assert actor_train_gib("--recompute-method", "block", "--recompute-num-layers", "28") == pytest.approx(full)
    assert actor_train_gib("--recompute-method", "block", "--recompute-num-layers", "14") > full + 1


def test_over_budget_exits_one_with_the_amount():
    proc = subprocess.run(
        [sys.executable, "-m", "megarl.plan", "--hf-config", str(REFERENCE / "llama3_1_70b" / "config.json"),
         "--world-size", "8", "--tp", "8", "--rollout-tp", "8", "--global-batch-size", "64"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert "over by" in proc.stdout and "DOES NOT FIT" in proc.stdout


def test_missing_flags_and_files_are_named():
    with pytest.raises(SystemExit, match="--hf-config needs --world-size and --global-batch-size"):
        main(["--hf-config", str(REFERENCE / "llama3_1_8b")])
    with pytest.raises(SystemExit, match="no HF config.json at"):
        main(["--hf-config", "/nonexistent/model", "--world-size", "8", "--global-batch-size", "8"])


@pytest.mark.parametrize(
    "recipe, model",
    [
        ("qwen2_5_7b_gsm8k_grpo", "qwen2_5_7b_instruct"),
        ("qwen2_5_7b_gsm8k_tools_grpo", "qwen2_5_7b_instruct"),
        ("llama3_1_70b_grpo", "llama3_1_70b"),
        ("qwen3_30b_a3b_grpo", "qwen3_30b_a3b"),
    ],
)
def test_recipe_fits_its_cluster(recipe, model, capsys):
    rc = main(["--config", str(REPO / "configs" / f"{recipe}.yaml"),
               f"actor_rollout_ref.model.path={REFERENCE / model}"])
    out = capsys.readouterr().out
    assert rc == 0, out


def test_deepseek_recipe_fits_its_cluster(capsys):
    from megarl.config.schema import MegatronConfig

    if "num_layers_in_first_pipeline_stage" not in MegatronConfig.__dataclass_fields__:
        pytest.skip("schema has no uneven pipeline split yet (num_layers_in_first/last_pipeline_stage)")
    rc = main(["--config", str(REPO / "configs" / "deepseek_v3_671b_grpo.yaml"),
               f"actor_rollout_ref.model.path={REFERENCE / 'deepseek_v3'}"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "layers per stage=[3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2]" in out


def test_embedded_model_path_plans_its_built_model(capsys):
    # the demo recipes plan as written (issue 37): the embedded model's directory holds its config.json
    assert main(["--config", str(REPO / "configs" / "grpo_tiny.yaml")]) == 0
    assert "FITS" in capsys.readouterr().out


def test_a_model_path_with_no_config_and_no_shipped_twin_names_the_shipped_configs(tmp_path):
    with pytest.raises(SystemExit, match=r"no HF config.json at .*MyModel-1B.*qwen2_5_7b_instruct"):
        main(["--config", str(REPO / "configs" / "grpo_tiny.yaml"),
              f"actor_rollout_ref.model.path={tmp_path / 'MyModel-1B'}"])
