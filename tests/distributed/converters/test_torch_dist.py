"""converters/hf_to_mcore.py's default output is megatron-core's torch_dist format:

- every chunk megatron asks for, read straight from the HF files into its fused place (no HF tensors, no fused
  parameter), is bitwise the chunk cut out of the fused parameter built the ordinary way, vocabulary padding
  included; a dtype change falls back to the ordinary way;
- one conversion loads, through plain ``megatron.core.dist_checkpointing.load`` of each model's own sharded
  state dict, into GPTModels built at TP=2, PP=2, EP=2 and TP=2 x PP=2 (gloo), and gives HF's logits;
- HF -> torch_dist -> HF is bit exact for every architecture, written in many parts (by two workers for one);
- a conversion killed mid-part leaves no tracker file, and rerunning it resumes to the same checkpoint;
- bad input (weights that do not match config.json, a truncated shard), a full disk (then resumed) and damaged
  output (a part's data file gone) are named, and nothing is marked complete.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from megarl.checkpoint_io.execution import KILL_AFTER_ENV, PROGRESS_FILE
from megarl.checkpoint_io.hf_index import index_hf_safetensors
from megarl.checkpoint_io.safetensors_stream import read_tensor
from megarl.checkpoint_io.files import TRACKER_FILE
from megarl.checkpoint_io.torch_dist_layout import ITERATION_DIR, PARTS_DIR
from megarl.checkpoint_io.torch_dist_reader import TorchDistReader
from tests.distributed.converters import mcore_load_workers
from tests.dist_harness import run_distributed
from tests.distributed.models.bridge_workers import hf_logits, sample_tokens
from tests.paths import REPO

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
LAYOUTS = {  # name: (processes, layout, architectures)
    "tp2": (2, dict(tensor_parallel=2), ARCHS),
    "pp2": (2, dict(pipeline_parallel=2), ("qwen2", "qwen3_moe")),
    "ep2": (2, dict(expert_parallel=2), ("qwen3_moe", "deepseek_v3")),
    "tp2_pp2": (4, dict(tensor_parallel=2, pipeline_parallel=2), ("qwen2",)),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Each architecture converted once (default options), with its HF logits on sample tokens."""
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("torch_dist")
    out = {}
    for arch in ARCHS:
        hf_dir = save_tiny_hf_checkpoint(arch, root / arch / "hf", seed=7)
        convert_hf_to_mcore(hf_dir, root / arch / "td")
        tokens = sample_tokens(250)
        out[arch] = dict(hf=hf_dir, ckpt=str(root / arch / "td"), tokens=tokens, logits=hf_logits(hf_dir, tokens))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_chunks_read_in_place_equal_the_chunks_of_the_fused_parameter(arch, tmp_path):
    from megarl.checkpoint_io import hf_to_mcore as h
    from megarl.checkpoint_io.torch_dist_layout import checkpoint_layout
    from megarl.models.tiny import save_tiny_hf_checkpoint

    # a vocabulary megatron pads (1000 -> 1024 rows) and a few tensors per file
    hf_dir = save_tiny_hf_checkpoint(arch, tmp_path / "hf", seed=3, vocab_size=1000)
    config = h.read_hf_config_dict(hf_dir)
    bridge = h.planning_bridge(config, "local")
    layout, locations = checkpoint_layout(bridge), index_hf_safetensors(hf_dir)
    for dtype, in_place in ((None, True), (torch.float64, False)):
        options = h.ConversionOptions(dtype=dtype)
        context = h._Context(*h._context_args(bridge, config, options, str(tmp_path)))
        tasks = h.plan_torch_dist(bridge, layout, locations, options)
        checked = 0
        for task in tasks:
            entries = {entry.global_name: entry for entry in task.payload.entries}
            for item in task.payload.items:
                entry = entries[item.param]
                chunk = h._read_chunk_in_place(item, entry, task.payload.dtypes[item.param], context)
                assert (chunk is not None) == in_place, item.key
                if chunk is None:
                    continue
                full = context.tensors.hf_to_mcore(item.param, {s.hf_name: h._load_source(s, context)
                                                                 for s in entry.sources}).contiguous()
                expected = item.take(full)
                assert chunk.dtype == expected.dtype and torch.equal(chunk, expected), item.key
                assert chunk.untyped_storage().nbytes() == chunk.numel() * chunk.element_size()  # nothing to clone
                checked += 1
        assert checked == (len(layout.tensors) if in_place else 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_one_conversion_loads_at_other_layouts_with_plain_megatron(layout_name, converted):
    processes, layout, archs = LAYOUTS[layout_name]
    results = run_distributed(mcore_load_workers.torch_dist_checkpoint_logits, processes, layout,
                              {a: converted[a]["ckpt"] for a in archs}, {a: converted[a]["tokens"] for a in archs},
                              timeout_s=280)
    compared = 0
    for rank_result in results:
        for arch in archs:
            got = rank_result[arch]["logits"]
            if got is None:  # not the last pipeline stage
                continue
            torch.testing.assert_close(got, converted[arch]["logits"], rtol=2e-4, atol=2e-4,
                                       msg=lambda m: f"{layout_name} {arch}: {m}")
            compared += 1
    last_stage_ranks = processes // (2 if "pipeline_parallel" in layout else 1)
    assert compared == len(archs) * last_stage_ranks


def test_the_checkpoint_has_megatron_lms_layout(converted):
    ckpt = converted["qwen2"]["ckpt"]
    assert open(os.path.join(ckpt, TRACKER_FILE)).read().strip() == "0"
    iteration = os.path.join(ckpt, ITERATION_DIR)
    assert json.load(open(os.path.join(iteration, "metadata.json")))["sharded_backend"] == "torch_dist"
    assert torch.load(os.path.join(iteration, "common.pt"), weights_only=False)["checkpoint_version"] == 3.0
    reader = TorchDistReader(ckpt)
    # megatron's own keys: a uniform decoder's layers stacked on a leading axis, fc1 = [gate; up]
    assert reader.shape("decoder.layers.mlp.linear_fc1.weight")[0] == 2
    assert "embedding.word_embeddings.weight" in reader.tensors
    assert not os.path.exists(os.path.join(ckpt, PROGRESS_FILE))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("arch", ARCHS)
def test_hf_torch_dist_hf_is_bit_exact_in_parts_and_workers(arch, tmp_path, monkeypatch):
    import transformers

    from megarl.checkpoint_io import safetensors_stream
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.checkpoint_io.mcore_to_hf import convert_mcore_to_hf
    from megarl.models.tiny import save_tiny_hf_checkpoint

    source = save_tiny_hf_checkpoint(arch, tmp_path / "hf", seed=3)
    workers = 2 if arch == "qwen3_moe" else 1  # worker processes cost seconds to start; one architecture shows it
    convert_hf_to_mcore(source, tmp_path / "td", workers=workers, max_file_bytes=40_000)
    assert len(os.listdir(tmp_path / "td" / ITERATION_DIR / PARTS_DIR)) >= 4  # really several parts
    copied = []  # the HF tensors copied file to file (seen here when this process runs the tasks)
    real_append = safetensors_stream.append_file_bytes
    monkeypatch.setattr(safetensors_stream, "append_file_bytes",
                        lambda source, fd: copied.append(source.nbytes) or real_append(source, fd))
    convert_mcore_to_hf(tmp_path / "td", tmp_path / "back", workers=workers, max_shard_bytes=30_000)
    original = {n: read_tensor(loc) for n, loc in index_hf_safetensors(source).items()}
    if workers == 1:  # all but fused q/k/v (and a tied or padded vocabulary) comes straight from the files
        assert sum(copied) > 0.5 * sum(t.nbytes for t in original.values())
    back = {n: read_tensor(loc) for n, loc in index_hf_safetensors(tmp_path / "back").items()}
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32)
    assert model.config.num_hidden_layers == transformers.AutoConfig.from_pretrained(source).num_hidden_layers


def _cli(args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(REPO), **(env_extra or {}))
    return subprocess.run([sys.executable, os.path.join(REPO, "converters", "hf_to_mcore.py"), *args],
                          env=env, capture_output=True, text=True, timeout=240)


def _all_keys(path):
    reader = TorchDistReader(str(path))
    return {key: reader.read(key, (0,) * len(reader.shape(key)), reader.shape(key)) for key in reader.tensors}


@pytest.mark.timeout(300)
def test_workers_forked_by_the_command_and_from_the_fork_server_write_the_same_checkpoint(tmp_path, monkeypatch):
    """The command line is one thread, so it forks its workers itself; a process running other threads (here
    made to look so) starts them from the fork server. Both give the checkpoint one process writes."""
    from megarl.checkpoint_io import execution
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    hf_dir = save_tiny_hf_checkpoint("qwen2", tmp_path / "hf", seed=4)
    forked = _cli(["--hf", str(hf_dir), "--out", str(tmp_path / "forked"), "--workers", "2",
                   "--max-file-size", "20000"])
    assert forked.returncode == 0, forked.stderr[-3000:]
    assert "2 conversion workers forked from this process" in forked.stderr
    monkeypatch.setattr(execution, "forking_is_safe", lambda: False)
    convert_hf_to_mcore(hf_dir, tmp_path / "served", workers=2, max_file_bytes=20_000)
    convert_hf_to_mcore(hf_dir, tmp_path / "alone", max_file_bytes=20_000)
    alone = _all_keys(tmp_path / "alone")
    for other in (_all_keys(tmp_path / "forked"), _all_keys(tmp_path / "served")):
        assert other.keys() == alone.keys() and all(torch.equal(other[k], alone[k]) for k in alone)


@pytest.mark.timeout(300)
def test_killed_conversion_resumes_to_the_same_checkpoint(tmp_path):
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    hf_dir = save_tiny_hf_checkpoint("qwen3_moe", tmp_path / "hf", seed=9)
    convert_hf_to_mcore(hf_dir, tmp_path / "clean", max_file_bytes=20_000)
    out = tmp_path / "resumed"
    args = ["--hf", str(hf_dir), "--out", str(out), "--max-file-size", "20KB"]
    killed = _cli(args, {KILL_AFTER_ENV: "40"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (out / TRACKER_FILE).exists() and not (out / ITERATION_DIR / ".metadata").exists()
    parts = out / ITERATION_DIR / PARTS_DIR
    done = sorted(name for name in os.listdir(parts) if ".tmp-" not in name)
    assert done and any(".tmp-" in name for name in os.listdir(parts))  # killed inside a part
    finished = {name: os.stat(parts / name / ".metadata") for name in done}

    resumed = _cli(args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming: {len(done)} of" in resumed.stderr
    for name, before in finished.items():
        after = os.stat(parts / name / ".metadata")
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), f"{name} was rewritten"
    assert not any(".tmp-" in name for name in os.listdir(parts))
    clean, again = _all_keys(tmp_path / "clean"), _all_keys(out)
    assert clean.keys() == again.keys()
    for key in clean:
        assert torch.equal(clean[key], again[key]), key


@pytest.mark.timeout(240)
def test_a_worker_killed_mid_part_fails_the_run_at_once_and_the_rerun_finishes(tmp_path, monkeypatch):
    """A dead worker (SIGKILL, as the OOM killer sends) must not leave the parent waiting for its result."""
    import time

    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    hf_dir = save_tiny_hf_checkpoint("qwen2", tmp_path / "hf", seed=5)
    monkeypatch.setenv(KILL_AFTER_ENV, "3")  # inherited by the spawned workers
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"a conversion worker stopped while running part\d+ .* rerun the same"):
        convert_hf_to_mcore(hf_dir, tmp_path / "out", workers=2, max_file_bytes=20_000)
    assert time.monotonic() - started < 120
    assert not (tmp_path / "out" / TRACKER_FILE).exists()
    monkeypatch.delenv(KILL_AFTER_ENV)
    convert_hf_to_mcore(hf_dir, tmp_path / "out", workers=2, max_file_bytes=20_000)
    assert (tmp_path / "out" / TRACKER_FILE).exists()
    convert_hf_to_mcore(hf_dir, tmp_path / "clean", max_file_bytes=20_000)
    clean, again = _all_keys(tmp_path / "clean"), _all_keys(tmp_path / "out")
    assert clean.keys() == again.keys() and all(torch.equal(clean[k], again[k]) for k in clean)


def test_weights_that_do_not_match_the_config_are_named_and_nothing_is_marked_complete(tmp_path):
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    hf_dir = save_tiny_hf_checkpoint("llama", tmp_path / "hf", seed=1)
    config_path = os.path.join(hf_dir, "config.json")
    config = json.load(open(config_path))
    json.dump(dict(config, intermediate_size=2 * config["intermediate_size"]), open(config_path, "w"))
    with pytest.raises(ValueError, match=r"decoder.layers.0.mlp.linear_fc1.weight: the HF tensors .* config and "
                                         r"weights do not match"):
        convert_hf_to_mcore(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out" / TRACKER_FILE).exists()


def test_a_truncated_shard_is_named(tmp_path):
    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    hf_dir = save_tiny_hf_checkpoint("qwen2", tmp_path / "hf", seed=1)
    shard = sorted(p for p in os.listdir(hf_dir) if p.endswith(".safetensors"))[-1]
    path = os.path.join(hf_dir, shard)
    with open(path, "r+b") as handle:
        handle.truncate(os.path.getsize(path) - 100)
    with pytest.raises(Exception, match=shard):
        convert_hf_to_mcore(hf_dir, tmp_path / "out")
    assert not (tmp_path / "out" / TRACKER_FILE).exists()


def test_a_part_whose_data_is_gone_is_named_when_read(converted, tmp_path):
    import shutil

    from megarl.checkpoint_io.mcore_to_hf import convert_mcore_to_hf

    damaged = tmp_path / "damaged"
    shutil.copytree(converted["llama"]["ckpt"], damaged)
    (part,) = os.listdir(damaged / ITERATION_DIR / PARTS_DIR)
    data = [name for name in os.listdir(damaged / ITERATION_DIR / PARTS_DIR / part) if name.endswith(".distcp")]
    with open(damaged / ITERATION_DIR / PARTS_DIR / part / data[0], "r+b") as handle:
        handle.truncate(10)
    with pytest.raises(ValueError, match=r"truncated .* needs bytes"):
        convert_mcore_to_hf(damaged, tmp_path / "back")
    assert not (tmp_path / "back" / "model.safetensors.index.json").exists()


@pytest.mark.timeout(120)
def test_a_full_disk_is_said_in_words_and_the_conversion_resumes_once_there_is_room(tmp_path):
    """A real full disk (a 300 kB tmpfs; needs root, as CI runs): the error names the disk and what is left, no
    tracker file is written, and after the tmpfs grows the same call finishes from the parts already there."""
    import errno

    from megarl.checkpoint_io.hf_to_mcore import convert_hf_to_mcore
    from megarl.models.tiny import save_tiny_hf_checkpoint

    hf_dir = save_tiny_hf_checkpoint("qwen3_moe", tmp_path / "hf", seed=9)
    convert_hf_to_mcore(hf_dir, tmp_path / "clean", max_file_bytes=20_000)
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(small)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(OSError, match=r"the disk holding .*small/out is full .* tasks done; the rest needs about "
                                          r".* rerun the same command") as info:
            convert_hf_to_mcore(hf_dir, small / "out", max_file_bytes=20_000)
        assert info.value.errno == errno.ENOSPC
        assert not (small / "out" / TRACKER_FILE).exists()
        subprocess.run(["mount", "-o", "remount,size=20m", str(small)], check=True)
        convert_hf_to_mcore(hf_dir, small / "out", max_file_bytes=20_000)
        clean, again = _all_keys(tmp_path / "clean"), _all_keys(small / "out")
        assert clean.keys() == again.keys() and all(torch.equal(clean[k], again[k]) for k in clean)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_a_config_that_does_not_match_the_checkpoint_is_named_on_the_way_back(converted, tmp_path):
    """mcore_to_hf with another model's config.json (wider MLP): named before anything is written."""
    import shutil

    from megarl.checkpoint_io.mcore_to_hf import convert_mcore_to_hf

    other = tmp_path / "other_config"
    shutil.copytree(converted["llama"]["hf"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(dict(config, intermediate_size=2 * config["intermediate_size"])))
    with pytest.raises(ValueError, match=r"linear_fc1.weight' is \(.*\), but config.json describes \(.*\): config "
                                         r"and checkpoint do not match"):
        convert_mcore_to_hf(converted["llama"]["ckpt"], tmp_path / "back", hf_config_dir=other)
    assert not (tmp_path / "back" / "model.safetensors.index.json").exists()
