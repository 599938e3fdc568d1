"""Vision-language GRPO on a GPU (the trainer in process, no Ray: the GPU box has none unless carried): the embedded
tiny Qwen2.5-VL on the shapes pictures, images through the HF rollout engine and the Megatron actor on CUDA, the
rollout's log-probs equal to the trainer's every step."""

import pytest
import torch

from megarl.run_config import load_config
from tests.paths import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_vision_language_grpo_on_cuda_scores_what_the_rollout_sampled(tmp_path):
    from megarl.trainer.main import run

    history = run(load_config(REPO / "configs" / "grpo_vl_tiny.yaml", [
        f"trainer.default_local_dir={tmp_path}", "trainer.backend=inprocess", "trainer.device=cuda",
        "trainer.total_training_steps=3", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.save_freq=-1", "trainer.progress_bar=false"]))
    assert [h["step"] for h in history] == [1, 2, 3]
    for h in history:
        # fp32 on both sides, CUDA kernels that differ between transformers and megatron (TF32 off): 1e-3 of
        # log-probs around -5 is far below what a lost or misplaced image does (0.2-0.3 on CPU)
        assert h["rollout/log_prob_diff_max"] < 1e-3, (h["step"], h["rollout/log_prob_diff_max"])
        assert h["prompt_length/mean"] == 84 + 6
