"""The planner's phases against a GPU run's logged device-wide peaks (`memory/<phase>/peak_gb` of a
bench/e2e_grpo.py result under docs/device_results/)."""

import json
from pathlib import Path

from megarl.plan.memory import GIB, PlanReport

H100_GIB = 85_520_809_984 / GIB  # torch's total_memory of the H100 80GB the measured runs had
PHASE_OF_LOGGED = {"rollout": "gen", "log-prob (old + ref)": "old_log_prob", "actor train": "update_actor"}


def assert_phases_within(report: PlanReport, result: Path, tolerance: float) -> dict[str, float]:
    """Each planned phase within ``tolerance`` of the run's steady peak; returns planned / measured per phase."""
    planned = {phase.phase: phase.total / GIB for phase in report.phases}
    steady = json.loads(result.read_text())["steady"]
    ratios = {}
    for phase, logged in PHASE_OF_LOGGED.items():
        measured = steady[f"memory/{logged}/peak_gb"] * 1e9 / GIB
        ratios[phase] = planned[phase] / measured
        print(f"{phase}: planned {planned[phase]:.2f} GiB, measured {measured:.2f} GiB ({ratios[phase]:.3f})")
    assert all(abs(ratio - 1) < tolerance for ratio in ratios.values()), ratios
    return ratios
