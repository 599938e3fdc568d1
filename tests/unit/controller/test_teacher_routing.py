"""Which teacher scores which row (distillation.teacher_key / teacher_models.*.key), and the distillation
settings refused at load time, by key."""

from __future__ import annotations

import pytest
import torch

from megarl.batch import TrainBatch
from megarl.config import ConfigError
from megarl.controller.roles import teacher_rows
from megarl.run_config import load_config

TEACHER = "distillation.teacher_models"


def _batch(sources, infos=None):
    rows = len(sources)
    ones = torch.ones(rows, 2, dtype=torch.long)
    return TrainBatch(prompt_ids=ones, prompt_mask=ones, response_ids=ones, response_mask=ones,
                      group_ids=[str(r) for r in range(rows)], data_sources=list(sources),
                      extra_infos=infos or [{} for _ in range(rows)])


def _cfg(*overrides):
    return load_config(overrides=["trainer.backend=ray", "distillation.enabled=true", *overrides])


def test_one_teacher_without_a_key_scores_every_row():
    cfg = _cfg(f"{TEACHER}.t.model_path=embedded:tiny-qwen2")
    assert teacher_rows(_batch(["a", "b", "a"]), cfg) == {"t": [0, 1, 2]}


def test_several_teachers_take_the_rows_their_key_names():
    cfg = _cfg(f"{TEACHER}.math.model_path=embedded:tiny-qwen2", f"{TEACHER}.math.key=gsm8k",
               f"{TEACHER}.code.model_path=embedded:tiny-qwen2", f"{TEACHER}.code.key=apps")
    assert teacher_rows(_batch(["apps", "gsm8k", "gsm8k", "apps"]), cfg) == {"math": [1, 2], "code": [0, 3]}
    with pytest.raises(ValueError, match=r"row 1 has data_source='aime', which no teacher's key names .*apps"):
        teacher_rows(_batch(["apps", "aime"]), cfg)
    by_info = _cfg(f"{TEACHER}.math.model_path=embedded:tiny-qwen2", f"{TEACHER}.math.key=m",
                   f"{TEACHER}.code.model_path=embedded:tiny-qwen2", f"{TEACHER}.code.key=c",
                   "distillation.teacher_key=domain")
    rows = teacher_rows(_batch(["x", "x"], [{"domain": "c"}, {"domain": "m"}]), by_info)
    assert rows == {"math": [1], "code": [0]}


@pytest.mark.parametrize("overrides, message", [
    ([], "needs a teacher"),
    ([f"{TEACHER}.a.model_path=embedded:tiny-qwen2", f"{TEACHER}.b.model_path=embedded:tiny-qwen2"],
     "with several teachers each needs its own key"),
    ([f"{TEACHER}.a.key=x"], r"distillation.teacher_models.a.model_path is not set"),
    ([f"{TEACHER}.a.model_path=embedded:tiny-qwen2", "distillation.distillation_loss.loss_mode=k1",
      "distillation.distillation_loss.use_policy_gradient=false"], "does not depend on the teacher"),
    ([f"{TEACHER}.a.model_path=embedded:tiny-qwen2", "distillation.distillation_loss.loss_mode=forward_kl_topk"],
     r"distillation.distillation_loss.loss_mode='forward_kl_topk' is not one of"),
    ([f"{TEACHER}.a.model_path=embedded:tiny-qwen2", "trainer.backend=inprocess"], "trainer.backend=inprocess"),
])
def test_distillation_settings_are_refused_by_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(*overrides)
