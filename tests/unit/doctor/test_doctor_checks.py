"""python -m megarl.doctor's reading of versions against the ranges megarl is tested with: what is in range, what
is outside (named with what breaks), what is missing (required: a failure; optional: what is unavailable)."""

import pytest

from megarl.doctor import check_version, environment_findings, version_tuple


@pytest.mark.parametrize("text, expected", [("0.26.0+cu130", (0, 26, 0)), ("2.13.0.dev20261101", (2, 13, 0)),
                                            ("0.16.1rc1", (0, 16, 1)), ("5.19.0", (5, 19, 0)), ("3.12.3", (3, 12, 3))])
def test_version_strings_become_tuples(text, expected):
    assert version_tuple(text) == expected


def test_in_range_outside_and_missing_are_told_apart():
    assert check_version("vllm", "0.32.0").level == "ok"
    assert check_version("vllm", "0.26.0+cu130").level == "ok"
    newer = check_version("vllm", "0.33.1")
    assert newer.level == "warn" and "outside the tested range 0.26 <= v < 0.33" in newer.detail
    assert "weight updates" in newer.detail  # what breaks with it
    assert check_version("megatron-core", "0.15.0").level == "warn"
    missing_optional = check_version("ray", None)
    assert missing_optional.level == "warn" and "trainer.backend=inprocess" in missing_optional.detail
    assert check_version("megatron-core", None).level == "fail"


def test_this_environment_reads_without_failures():
    findings = {f.name: f for f in environment_findings()}
    assert {"python", "torch", "megatron-core", "transformers", "vllm", "ray", "host memory"} <= set(findings)
    assert not [f.line() for f in findings.values() if f.level == "fail"]
