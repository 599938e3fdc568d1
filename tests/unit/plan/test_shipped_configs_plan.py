"""The planner runs on every shipped recipe as written (issue 37): a recipe whose checkpoint is not on this machine
is planned with the shipped reference config of the same model, and says so; the tiny recipes plan their embedded
model. Every recipe fits the hardware it names."""

import pytest

from tests.paths import REPO

RECIPES = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_shipped_recipe_plans_as_written_and_fits(recipe, capsys):
    from megarl.plan.__main__ import main

    assert main(["--config", str(recipe)]) == 0, capsys.readouterr().out[-2000:]
    out = capsys.readouterr().out
    assert "FITS" in out
    if "checkpoints/hf/" in recipe.read_text():
        assert "planned with the shipped" in out
