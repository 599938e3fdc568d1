"""A torch_dist checkpoint's stored items read as mappings of their bytes in the file, or located as byte ranges
of it, equal the items ``torch.load`` reads, and items that are not a plain float tensor are loaded instead of
misread."""

import io

import torch
import torch.distributed.checkpoint as dcp

from megarl.checkpoint_io.torch_dist_reader import TorchDistReader


def test_mapped_items_equal_the_loaded_ones_and_only_plain_float_tensors_are_mapped(tmp_path, monkeypatch):
    state = {"bf16": torch.randn(33, 7).to(torch.bfloat16), "fp32": torch.randn(5), "half": torch.randn(2, 3).half(),
             "ints": torch.arange(11, dtype=torch.int64)}
    dcp.save(state, checkpoint_id=str(tmp_path))
    reader = TorchDistReader(str(tmp_path))
    loaded = {key: reader.read(key, (0,) * t.dim(), tuple(t.shape)) for key, t in state.items()}
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(1) or real_load(*a, **k))
    for key, tensor in state.items():
        calls.clear()
        mapped = reader.read(key, (0,) * tensor.dim(), tuple(tensor.shape), mapped=True)
        assert mapped.dtype == tensor.dtype and torch.equal(mapped, tensor) and torch.equal(loaded[key], tensor)
        assert len(calls) == (1 if key == "ints" else 0), key  # int64 has no mappable storage: loaded


def test_a_view_into_a_larger_storage_maps_to_its_own_elements_at_any_file_offset(tmp_path):
    base = torch.randn(10, 6).to(torch.bfloat16)
    view = base[3:8, 1:5]  # torch.save keeps the whole storage, an offset and strides
    saved = io.BytesIO()
    torch.save(view, saved)
    path = tmp_path / "items"
    path.write_bytes(b"x" * 13 + saved.getvalue() + b"tail")  # off every page and alignment boundary
    mapped = TorchDistReader._map_chunk(str(path), 13, len(saved.getvalue()))
    assert mapped is not None and mapped.shape == view.shape and torch.equal(mapped, view)


def test_an_item_that_is_not_a_plain_tensor_is_not_mapped(tmp_path):
    saved = io.BytesIO()
    torch.save(torch.nn.Parameter(torch.randn(4)), saved)  # rebuilt by another function: refused by the reader
    path = tmp_path / "item"
    path.write_bytes(saved.getvalue())
    assert TorchDistReader._map_chunk(str(path), 0, len(saved.getvalue())) is None


def test_a_stored_chunk_located_in_its_file_holds_the_chunks_bytes(tmp_path):
    state = {"bf16": torch.randn(33, 7).to(torch.bfloat16), "fp32": torch.randn(5, 2, 3),
             "ints": torch.arange(11, dtype=torch.int64)}
    dcp.save(state, checkpoint_id=str(tmp_path))
    reader = TorchDistReader(str(tmp_path))
    for key in ("bf16", "fp32"):
        tensor = state[key]
        found = reader.chunk_in_file(key, (0,) * tensor.dim(), tuple(tensor.shape))
        assert found.dtype == tensor.dtype and found.shape == tuple(tensor.shape)
        with open(found.path, "rb") as handle:
            handle.seek(found.start)
            stored = handle.read(found.nbytes)
        assert stored == tensor.contiguous().view(torch.uint8).numpy().tobytes(), key
    assert reader.chunk_in_file("ints", (0,), (11,)) is None  # not a mappable storage: read() loads it
    assert reader.chunk_in_file("bf16", (0, 0), (32, 7)) is None  # not a stored chunk: read() assembles it
