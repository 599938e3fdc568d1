"""async_training.mode=one_step_off end to end on CPU (real Ray, a training and a rollout process): the next
batch is generated while the current one trains, each batch one update old; a run stopped by SIGTERM keeps
the batch it had generated for the next step in its checkpoint, and resuming continues exactly as the
uninterrupted run did."""

from pathlib import Path

import pytest

from megarl.run_config import load_config
from tests.paths import REPO

SEPARATE = ["trainer.placement=separate", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1",
            "async_training.mode=one_step_off"]
CURVE_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean",
              "rollout/log_prob_diff_mean")
# The digit task's own scorer, counting the samples it scores; the driver sends itself SIGTERM (what a scheduler
# sends before a time limit) while it scores the batch of step STOP_AT_STEP.
SCORER = '''
import os, signal
from megarl.rewards.routing import ScorerRouter

_router, _calls = ScorerRouter(), 0


def compute_score(data_source, solution_str, ground_truth, extra_info):
    global _calls
    _calls += 1
    if _calls == {stop_at_sample}:
        os.kill(os.getpid(), signal.SIGTERM)
    return _router.scorer_for(data_source)(solution_str, ground_truth)
'''


def _config(out: Path, scorer: Path, *overrides: str):
    return load_config(REPO / "configs" / "grpo_tiny.yaml", [
        f"trainer.default_local_dir={out}", "trainer.progress_bar=false", "trainer.val_before_train=false",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.total_training_steps=4",
        f"reward_model.custom_function.path={scorer}", *SEPARATE, *overrides,
    ])


def _scorer(path: Path, stop_at_sample: int) -> Path:
    path.write_text(SCORER.format(stop_at_sample=stop_at_sample))
    return path


@pytest.mark.timeout(600)
def test_one_step_off_trains_one_update_behind_and_resumes_what_was_in_flight(tmp_path):
    from megarl.trainer.main import run

    straight = run(_config(tmp_path / "straight", _scorer(tmp_path / "never.py", -1)))
    assert [row["rollout/weight_lag"] for row in straight] == [0.0, 1.0, 1.0, 1.0]
    # one update behind: the trainer's log-probs differ from the sampler's (they are equal to ~1e-6 when in step)
    assert straight[0]["rollout/log_prob_diff_mean"] < 1e-4 < straight[1]["rollout/log_prob_diff_mean"]
    assert all("timing_s/wait_rollout" in row for row in straight[:3]) and "timing_s/wait_rollout" not in straight[3]

    per_step = 16 * 8  # data.train_batch_size x rollout.n
    stopped_dir = tmp_path / "stopped"
    stopped = run(_config(stopped_dir, _scorer(tmp_path / "stop.py", per_step + 1)))  # SIGTERM while scoring step 2
    assert [row["step"] for row in stopped] == [1, 2]
    assert (stopped_dir / "checkpoints" / "global_step_2" / "in_flight_rollout.pt").is_file()
    # the same scores from a file that sends no signal: another reward path, which resuming must be allowed
    resumed = run(_config(stopped_dir, _scorer(tmp_path / "never_again.py", -1), "trainer.resume_allow_changes=true"))
    assert [row["step"] for row in resumed] == [3, 4]
    for expected, got in zip(straight[2:], resumed):
        for key in CURVE_KEYS:
            assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), (got["step"], key)
