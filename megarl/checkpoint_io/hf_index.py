"""Locate every tensor of a Hugging Face safetensors checkpoint without reading any tensor data.

Handles a sharded checkpoint (``model.safetensors.index.json`` + shards) or a single
``model.safetensors``. The index's weight map is checked against each shard's own header, so a
truncated or mismatched shard is reported by file name before a conversion starts.

Left out: ``pytorch_model.bin`` (pickle) checkpoints; convert those with transformers first.
"""

from __future__ import annotations

import json
import os

from megarl.checkpoint_io.safetensors_stream import TensorLocation, read_safetensors_header

HF_ASSETS_DIR = "hf_assets"  # a converted checkpoint keeps the HF tokenizer/config files here
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_ASSET_MAX_BYTES = 64 * 1024 * 1024
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def hf_asset_names(hf_dir: str | os.PathLike) -> list[str]:
    """The small non-weight files of an HF model directory (config, tokenizer, generation config, chat
    template) that travel with converted or exported weights."""
    hf_dir = os.fspath(hf_dir)
    names = []
    for name in sorted(os.listdir(hf_dir)):
        path = os.path.join(hf_dir, name)
        if (not os.path.isfile(path) or name.endswith(_WEIGHT_SUFFIXES) or name == INDEX_FILE
                or ".tmp-" in name or os.path.getsize(path) > _ASSET_MAX_BYTES):
            continue
        names.append(name)
    return names


def index_hf_safetensors(hf_dir: str | os.PathLike) -> dict[str, TensorLocation]:
    hf_dir = os.fspath(hf_dir)
    index_path = os.path.join(hf_dir, INDEX_FILE)
    single_path = os.path.join(hf_dir, SINGLE_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as handle:
            weight_map = json.load(handle).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no (or an empty) 'weight_map' object")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(single_path):
        weight_map, files = None, [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"{hf_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} exists")
    locations: dict[str, TensorLocation] = {}
    for file_name in files:
        path = os.path.join(hf_dir, file_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{index_path} names shard {file_name!r}, which does not exist")
        header, _ = read_safetensors_header(path)
        for name, location in header.items():
            if name in locations:
                raise ValueError(f"tensor {name!r} appears in both {locations[name].path} and {path}")
            if weight_map is not None and weight_map.get(name) != file_name:
                raise ValueError(f"{path} holds {name!r}, but {INDEX_FILE} maps it to {weight_map.get(name)!r}")
            locations[name] = location
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(locations))
        if missing:
            raise ValueError(f"{INDEX_FILE} lists tensors that no shard holds: {missing[:5]} "
                             f"({len(missing)} in all)")
    return locations
