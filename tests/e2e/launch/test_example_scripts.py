"""verl-style example launch scripts (examples/*/run_*.sh, every key on the command line) load, validate and plan
as written: ``VALIDATE_ONLY=1 bash <script>`` exits 0 with a plan that fits (issue 37)."""

import os
import subprocess
import sys

import pytest

from tests.paths import REPO

SCRIPTS = sorted((REPO / "examples").glob("*/run_*.sh"))


def test_there_are_example_scripts():
    assert len(SCRIPTS) >= 4


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.stem for s in SCRIPTS])
def test_example_script_validates_and_fits(script, tmp_path):
    env = dict(os.environ, VALIDATE_ONLY="1", PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    result = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "config valid:" in result.stdout and "FITS" in result.stdout
