"""The warnings megatron-core prints on every import without Transformer Engine / apex are hidden, in the driver
and (through PYTHONWARNINGS) in the workers; other warnings, megatron's included, still show."""

import warnings

from megarl.controller.worker_env import worker_env_for
from megarl.engines.megatron.expected_warnings import EXPECTED, hide_expected_warnings, python_warnings_env

SEEN = ("Transformer Engine and Apex are not installed. Falling back to local implementations of "
        "multi_tensor_applier, multi_tensor_l2norm, and multi_tensor_scale",
        "Apex is not installed. Falling back to Torch Norm")
OTHER = "Transformer Engine is installed but too old"


def _shown(install) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install()
        for message in SEEN + (OTHER,):
            warnings.warn(message, UserWarning)
    return [str(w.message) for w in caught]


def test_the_driver_hides_only_the_expected_ones():
    assert _shown(hide_expected_warnings) == [OTHER]


def test_the_workers_environment_hides_them_too():
    env = worker_env_for("cpu")["PYTHONWARNINGS"]
    assert env == python_warnings_env() and len(env.split(",")) == len(EXPECTED)
    assert _shown(lambda: [warnings._setoption(option) for option in env.split(",")]) == [OTHER]
    assert python_warnings_env("error::DeprecationWarning").startswith("error::DeprecationWarning,ignore:")
