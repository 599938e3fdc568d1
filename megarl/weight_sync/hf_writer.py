"""Export the trained policy as a Hugging Face checkpoint: a transport whose destination is a directory.

The weight-sync gather already yields the model as HF-named, full tensors in bounded buckets; this
transport writes them into safetensors shards of at most ``max_shard_bytes`` (one shard in host memory
at a time), then the tokenizer/generation files of the source model, ``config.json`` (dtype set to the
written one, an FP8 source's ``quantization_config`` dropped) and ``model.safetensors.index.json`` last:
a directory without the index is not a loadable checkpoint. ``transformers``/vLLM load the result as is.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from megarl.checkpoint_io.files import write_json_atomically
from megarl.checkpoint_io.hf_index import INDEX_FILE, hf_asset_names
from megarl.weight_sync.buckets import NamedTensors, tensor_bytes
from megarl.weight_sync.transport import WeightTransport

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class HFCheckpointWriter(WeightTransport):
    def __init__(self, out_dir: str | os.PathLike, *, source_dir: str | os.PathLike,
                 tokenizer_dir: str | os.PathLike | None = None, max_shard_bytes: int = 2 * 10**9):
        """``source_dir``: the HF model trained from (config and assets); ``tokenizer_dir``: where the
        tokenizer files come from when they are not in ``source_dir``."""
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.out_dir, self.source_dir = Path(out_dir), Path(source_dir)
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else None
        if (self.out_dir / INDEX_FILE).exists():
            raise FileExistsError(f"{self.out_dir / INDEX_FILE} exists: {self.out_dir} already holds a checkpoint")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._weight_map: dict[str, str] = {}
        self._total_bytes = 0
        self._dtypes: set[torch.dtype] = set()

    def send(self, bucket: NamedTensors) -> None:
        for name, tensor in bucket:
            if name in self._weight_map or name in self._pending:
                raise ValueError(f"{name} was exported twice")
            size = tensor_bytes(tensor)
            if self._pending and self._pending_bytes + size > self.max_shard_bytes:
                self._write_shard()
            # a host copy of its own: bucket tensors may be views into live parameters or device buffers
            self._pending[name] = tensor.detach().to("cpu", copy=True).contiguous()
            self._pending_bytes += size
            self._dtypes.add(tensor.dtype)

    def _write_shard(self) -> None:
        from safetensors.torch import save_file

        file_name = f"model-{len(set(self._weight_map.values())) + 1:05d}.safetensors"
        save_file(self._pending, str(self.out_dir / file_name), metadata={"format": "pt"})
        self._weight_map.update({name: file_name for name in self._pending})
        self._total_bytes += self._pending_bytes
        self._pending, self._pending_bytes = {}, 0

    def finish(self) -> None:
        if self._pending:
            self._write_shard()
        if not self._weight_map:
            raise ValueError("no tensors were exported")
        for directory in [self.source_dir] + ([self.tokenizer_dir] if self.tokenizer_dir else []):
            for name in hf_asset_names(directory):
                if name != "config.json":  # a tokenizer directory's wins: it is what the run used
                    shutil.copyfile(directory / name, self.out_dir / name)
        config = json.loads((self.source_dir / "config.json").read_text())
        config.pop("quantization_config", None)  # the exported weights are plain floats
        floats = [_DTYPE_NAMES[d] for d in self._dtypes if d in _DTYPE_NAMES]
        if floats:
            dtype = "bfloat16" if "bfloat16" in floats else sorted(floats)[0]
            config["torch_dtype"] = dtype
            if "dtype" in config:  # the newer transformers name
                config["dtype"] = dtype
        write_json_atomically(self.out_dir / "config.json", config)
        write_json_atomically(self.out_dir / INDEX_FILE, {"metadata": {"total_size": self._total_bytes},
                                                "weight_map": self._weight_map})
