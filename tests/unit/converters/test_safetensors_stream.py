"""The streaming safetensors writer/reader agree with the safetensors library, publish files atomically,
and refuse plan mismatches and corrupt headers with errors that name the tensor or file."""

import errno
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarl.checkpoint_io.safetensors_stream import (
    FileBytes, PlannedTensor, StreamingSafetensorsWriter, map_rows, read_safetensors_header, read_tensor,
)


def test_written_file_reads_back_with_safe_open_and_pread(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
               "c": torch.randn(4, 2).to(torch.bfloat16), "d": torch.randn(2, 3).to(torch.float8_e4m3fn)}
    path = str(tmp_path / "x.safetensors")
    writer = StreamingSafetensorsWriter(path, [PlannedTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()],
                                        metadata={"format": "pt"})
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    assert not os.path.exists(path)  # nothing under the final name before close()
    size, _ = writer.close()
    assert size == os.path.getsize(path)
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name).view(torch.uint8), tensor.view(torch.uint8))
    header, _ = read_safetensors_header(path)
    assert torch.equal(read_tensor(header["a"], row_start=1, row_end=3), tensors["a"][1:3])


@pytest.mark.parametrize("kernel_copy", ["copy_file_range", "refused"])
@pytest.mark.parametrize("checksum", [False, True])
def test_tensors_added_as_file_bytes_write_the_same_file_as_the_tensors(tmp_path, monkeypatch, kernel_copy, checksum):
    # the source's tensors sit at odd byte offsets; small tensors written through the buffered handle come
    # between the ranges the kernel copies, so a wrong file position after a copy would show
    source = {"pad": torch.arange(3, dtype=torch.int8), "w": torch.randn(700, 33).to(torch.bfloat16),
              "norm": torch.randn(5), "u": torch.randn(300, 7)}
    source_path = str(tmp_path / "source.safetensors")
    save_file(source, source_path)
    header, _ = read_safetensors_header(source_path)
    order = [("norm", source["norm"]), ("w", source["w"]), ("b", torch.randn(3)), ("u", source["u"]),
             ("w_rows", source["w"][100:400]), ("empty", torch.zeros(0, 4))]
    in_file = {name: FileBytes(source_path, header[name].start, header[name].dtype, header[name].shape)
               for name in ("norm", "w", "u")}
    row_bytes = 33 * 2
    in_file["w_rows"] = FileBytes(source_path, header["w"].start + 100 * row_bytes, torch.bfloat16, (300, 33))
    in_file["empty"] = FileBytes(source_path, header["u"].start, torch.float32, (0, 4))
    if kernel_copy == "refused":  # a kernel or file system without copy_file_range between these files
        def refuse(*args):
            raise OSError(errno.EXDEV, "cross-device")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    plan = [PlannedTensor(name, t.dtype, tuple(t.shape)) for name, t in order]
    results = {}
    for how in ("tensors", "file_bytes"):
        path = str(tmp_path / f"{how}.safetensors")
        writer = StreamingSafetensorsWriter(path, plan, metadata={"format": "pt"}, checksum=checksum)
        for name, tensor in order:
            writer.add(name, in_file[name] if how == "file_bytes" and name in in_file else tensor)
        results[how] = writer.close()
        assert results[how][0] == os.path.getsize(path)
    assert results["file_bytes"] == results["tensors"]  # same size and CRC
    written = (tmp_path / "file_bytes.safetensors").read_bytes()
    assert written == (tmp_path / "tensors.safetensors").read_bytes()
    with safe_open(str(tmp_path / "file_bytes.safetensors"), framework="pt") as handle:
        for name, tensor in order:
            assert torch.equal(handle.get_tensor(name), tensor), name


def test_file_bytes_past_the_end_of_the_file_are_an_error(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"x" * 10)
    writer = StreamingSafetensorsWriter(str(tmp_path / "out.safetensors"), [PlannedTensor("t", torch.float32, (4,))],
                                        checksum=False)
    with pytest.raises(ValueError, match="short: ends before byte 22"):
        writer.add("t", FileBytes(str(path), 6, torch.float32, (4,)))
    writer.abort()


def test_reader_matches_files_written_by_safetensors(tmp_path):
    path = str(tmp_path / "y.safetensors")
    tensors = {"w": torch.randn(6, 4), "v": torch.randn(9).half()}
    save_file(tensors, path)
    header, _ = read_safetensors_header(path)
    for name, tensor in tensors.items():
        assert torch.equal(read_tensor(header[name]), tensor)


def test_mapped_rows_equal_the_read_rows_at_any_offset_and_stay_valid_without_the_file_handle(tmp_path):
    # an odd-sized first tensor puts the second one's bytes off every page boundary
    tensors = {"pad": torch.arange(3, dtype=torch.int8), "w": torch.randn(2000, 5).to(torch.bfloat16),
               "norm": torch.randn(7)}
    path = str(tmp_path / "m.safetensors")
    save_file(tensors, path)
    header, _ = read_safetensors_header(path)
    for first, rows in ((0, 2000), (1, 1), (819, 1000), (2000, 0)):
        mapped = map_rows(header["w"], first, rows)
        assert mapped.shape == (rows, 5) and mapped.untyped_storage().nbytes() == mapped.nbytes
        assert torch.equal(mapped, read_tensor(header["w"], row_start=first, row_end=first + rows))
    assert torch.equal(map_rows(header["norm"], 2, 5), tensors["norm"][2:])
    with pytest.raises(ValueError, match="w: rows \\[1999, 2001\\) outside"):
        map_rows(header["w"], 1999, 2)


def test_plan_mismatch_and_early_close_raise_and_leave_no_file(tmp_path):
    path = str(tmp_path / "z.safetensors")
    writer = StreamingSafetensorsWriter(path, [PlannedTensor("a", torch.float32, (2, 2)),
                                               PlannedTensor("b", torch.float32, (2,))])
    with pytest.raises(ValueError, match=r"tensor 'a' is torch.float32\(3, 2\), planned torch.float32\(2, 2\)"):
        writer.add("a", torch.zeros(3, 2))
    with pytest.raises(ValueError, match="got tensor 'b', planned 'a' next"):
        writer.add("b", torch.zeros(2))
    writer.add("a", torch.zeros(2, 2))
    with pytest.raises(ValueError, match="1 planned tensors unwritten"):
        writer.close()
    assert os.listdir(tmp_path) == []


def test_corrupt_header_names_the_file(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(ValueError, match="bad.safetensors: header length"):
        read_safetensors_header(path)
    path.write_bytes(struct.pack("<Q", 2) + b"{x")
    with pytest.raises(ValueError, match="bad.safetensors: header is not valid JSON"):
        read_safetensors_header(path)
