"""async_training config checks name the key and what it needs."""

import pytest

from megarl.config import ConfigError
from megarl.run_config import load_config
from tests.paths import REPO

SEPARATE = ["trainer.placement=separate", "trainer.n_gpus_per_node=2", "trainer.rollout_gpus=1",
            "async_training.mode=one_step_off"]


@pytest.mark.parametrize("overrides, message", [
    (["async_training.mode=one_step_off"], r"needs trainer.placement=separate"),
    (SEPARATE + ["algorithm.filter_groups.enable=true"], r"needs algorithm.filter_groups.enable=false"),
    (SEPARATE + ["algorithm.adv_estimator=remax"], r"needs an estimator other than remax"),
    (SEPARATE + ["trainer.backend=inprocess"], r"trainer.backend=inprocess runs one rank|needs trainer.backend=ray"),
    (SEPARATE[:-1] + ["async_training.mode=fully"],
     r"async_training.mode='fully' is not one of sync, one_step_off, fully_async"),
    (SEPARATE[:-1] + ["async_training.mode=fully_async", "async_training.max_staleness=0"],
     r"async_training.max_staleness must be > 0"),
    (SEPARATE[:-1] + ["async_training.mode=fully_async", "async_training.trigger_parameter_sync_step=2"],
     r"trigger_parameter_sync_step=2 pushes weights less often than async_training.max_staleness=1"),
    (SEPARATE[:-1] + ["async_training.mode=fully_async", "async_training.stale_policy=reweight"],
     r"needs|set it"),
    (SEPARATE[:-1] + ["async_training.mode=fully_async", "async_training.stale_policy=keep"],
     r"async_training.stale_policy='keep' is not one of drop, reweight"),
    (["async_training.mode=fully_async"], r"needs trainer.placement=separate"),
])
def test_async_training_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(REPO / "configs" / "grpo_tiny.yaml", overrides)


def test_one_step_off_with_separate_placement_validates():
    cfg = load_config(REPO / "configs" / "grpo_tiny.yaml", SEPARATE)
    assert cfg.async_training.mode == "one_step_off"
