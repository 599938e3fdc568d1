"""How megarl publishes a file that must be whole or absent: one atomic write (a temporary file, fsync, rename, then
the directory's fsync), and Megatron-LM's tracker file (``latest_checkpointed_iteration.txt``: the iteration of the
newest complete checkpoint in a directory), read and written by the trainer, the engines and the converters alike.
Leaves out: what goes in the files (the formats live with their readers and writers)."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

TRACKER_FILE = "latest_checkpointed_iteration.txt"  # Megatron-LM's marker of the newest checkpoint
OLD_TRACKER_FILE = "latest"  # what megarl's engine checkpoints named their tracker before; still read
RELEASE = -1  # tracked_iteration's answer for Megatron-LM's release/ directory


def fsync_directory(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(temporary: str | os.PathLike, path: str | os.PathLike) -> None:
    """A file written completely at ``temporary`` (by any writer) becomes ``path`` in one step: readers see the old
    file or the whole new one, and a crash leaves no truncated file under the final name."""
    with open(temporary, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_directory(os.path.dirname(os.fspath(path)) or ".")


def temporary_name(path: str | os.PathLike) -> str:
    """A sibling name of ``path`` for one process's write (concurrent writers must not clobber each other)."""
    path = os.fspath(path)
    head, name = os.path.split(path)
    return os.path.join(head, f".{name}.tmp-{os.getpid()}")


def write_atomically(path: str | os.PathLike, data: bytes | str) -> None:
    temporary = temporary_name(path)
    with open(temporary, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
    publish(temporary, path)


def write_json_atomically(path: str | os.PathLike, data: Any, *, indent: int = 2) -> None:
    """``data`` as JSON (sorted keys, a final newline) at ``path``, atomically (config.json, indexes, metadata)."""
    write_atomically(path, json.dumps(data, indent=indent, sort_keys=True) + "\n")


def mark_latest(checkpoint_dir: str | os.PathLike, iteration: int = 0) -> None:
    """Megatron-LM's tracker file: the checkpoint ``iteration`` under ``checkpoint_dir`` is complete."""
    write_atomically(os.path.join(os.fspath(checkpoint_dir), TRACKER_FILE), f"{iteration}\n")


def tracked_iteration(checkpoint_dir: str | os.PathLike) -> Optional[int]:
    """The iteration ``checkpoint_dir``'s tracker file names (:data:`RELEASE` for ``release``), or None when it
    has none: no complete checkpoint there."""
    for tracker in (TRACKER_FILE, OLD_TRACKER_FILE):
        path = os.path.join(os.fspath(checkpoint_dir), tracker)
        if not os.path.isfile(path):
            continue
        text = open(path).read().strip()
        if text == "release":  # Megatron-LM's name for a converted checkpoint's only iteration
            return RELEASE
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{path}: expected an integer iteration or 'release', found {text!r}") from None
    return None
