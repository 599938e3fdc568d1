"""A truncated safetensors file is named in the error, whether its header or its data is cut."""

import pytest
import torch
from safetensors.torch import save_file

from megarl.models.hf_checkpoint import HFCheckpointReader


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_safetensors_names_the_file(tmp_path, keep):
    path = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"model.safetensors \(\d+ bytes\) is not a readable safetensors file"):
        HFCheckpointReader(tmp_path).get("model.embed_tokens.weight")
