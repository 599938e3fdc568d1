"""Every training and planning command the README shows, as written, loads and validates (``--validate-only``:
nothing starts) and plans where it can: an example cannot drift from the code again (the outside probe found the
README's rloo example exiting 2). Commands with placeholders (``<...>``) are left out; the CPU demo itself runs in
tests/e2e."""

from __future__ import annotations

import contextlib
import io
import re
import shlex

import pytest

from tests.paths import REPO


def readme_commands(program: str) -> list[str]:
    """``python -m <program> ...`` command lines of the README's indented code blocks, continuations joined,
    comments cut."""
    lines = (REPO / "README.md").read_text().splitlines()
    commands, index = [], 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("    ") and f"python -m {program} " in line:
            text = line.split(f"python -m {program} ", 1)[1]
            while text.rstrip().endswith("\\") and index + 1 < len(lines):
                index += 1
                text = text.rstrip()[:-1] + " " + lines[index].strip()
            commands.append(re.sub(r"\s+#.*$", "", text).strip())
        index += 1
    return [c for c in commands if "<" not in c and "..." not in c]


TRAINER_COMMANDS = readme_commands("megarl.trainer.main")
PLAN_COMMANDS = readme_commands("megarl.plan")


def test_the_readme_shows_commands_to_check():
    assert len(TRAINER_COMMANDS) >= 6 and len(PLAN_COMMANDS) >= 1


@pytest.mark.parametrize("command", TRAINER_COMMANDS)
def test_trainer_commands_validate(command, monkeypatch):
    from megarl.trainer.main import cli

    monkeypatch.chdir(REPO)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(shlex.split(command) + ["--validate-only"])
    assert code == 0, (command, out.getvalue(), err.getvalue())
    assert "config valid" in out.getvalue()


@pytest.mark.parametrize("command", PLAN_COMMANDS)
def test_plan_commands_run_and_fit(command, monkeypatch):
    from megarl.plan.__main__ import main

    monkeypatch.chdir(REPO)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(shlex.split(command)) == 0, out.getvalue()
    assert out.getvalue().rstrip().endswith("FITS")
