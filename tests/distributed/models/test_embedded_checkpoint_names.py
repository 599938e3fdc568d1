"""The embedded models whose tensors transformers names otherwise in memory (Qwen3-MoE's fused experts,
Qwen2.5-VL's ``model.language_model.*``) are written under the names a published checkpoint gives them, which is
what the bridge, the converters and the weight sync read. (A cache built by an earlier format is not reused:
``EMBEDDED_FORMAT``.)"""

from __future__ import annotations

import pytest
from safetensors import safe_open

from megarl.models.embedded import ensure_embedded_model


@pytest.mark.parametrize("name,expected,in_memory_only", [
    ("tiny-qwen3-moe", "model.layers.0.mlp.experts.0.gate_proj.weight", "mlp.experts.gate_up_proj"),
    ("tiny-qwen2-vl", "visual.patch_embed.proj.weight", "model.language_model."),
])
def test_the_embedded_checkpoint_holds_the_published_names(tmp_path, name, expected, in_memory_only):
    model_dir = ensure_embedded_model(name, root=tmp_path)
    names = set()
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            names.update(handle.keys())
    assert expected in names and "model.layers.0.self_attn.q_proj.weight" in names
    assert not any(in_memory_only in n for n in names), sorted(names)[:5]
