"""Images of multimodal prompts, in verl's parquet layout: an ``images`` column beside ``prompt``, one list per
row of ``{bytes, path}`` entries (Hugging Face datasets' image struct: encoded bytes, or a file path when bytes is
null), and one ``<image>`` placeholder in the prompt's text per image, in order.

Entries stay encoded (PNG/JPEG bytes) from the file to the model's processor; :func:`open_image` decodes one
when a model or a check needs pixels. Every error names the file and row.

Left out: videos (verl's ``videos`` column).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pyarrow as pa

IMAGE_PLACEHOLDER = "<image>"
IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def image_entry(data: bytes | None = None, path: str | None = None) -> dict[str, Any]:
    if (data is None) == (path is None):
        raise ValueError("an image entry holds encoded bytes or a path, exactly one of them")
    return {"bytes": data, "path": path}


def read_image_entries(value: Any, where: str, column: str = "images") -> list[dict[str, Any]]:
    """A row's ``images`` cell (``column``: the dataset's ``data.image_key``) as a list of ``{bytes, path}`` entries
    (a bare bytes or path item is one too)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{where}: column {column!r} must be a list of images, got {type(value).__name__}")
    entries = []
    for i, item in enumerate(value):
        if isinstance(item, (bytes, bytearray)):
            item = {"bytes": bytes(item), "path": None}
        elif isinstance(item, str):
            item = {"bytes": None, "path": item}
        if not isinstance(item, dict) or (item.get("bytes") is None and not item.get("path")):
            raise ValueError(f"{where}: {column}[{i}] must hold image bytes or a path, got {item!r:.200}")
        entries.append({"bytes": item.get("bytes"), "path": item.get("path")})
    return entries


def open_image(entry: dict[str, Any], where: str, *, base_dir: Path | None = None):
    """The entry decoded as an RGB ``PIL.Image``; a relative path is read from ``base_dir`` (the parquet file's
    folder)."""
    from PIL import Image, UnidentifiedImageError

    data = entry.get("bytes")
    if data is None:
        path = Path(entry["path"])
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ValueError(f"{where}: cannot read image file {str(path)!r}: {err}") from None
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{where}: the image is not a readable picture ({err})") from None


def check_one_placeholder_per_image(entries: list[dict[str, Any]], prompt: Any, where: str = "") -> None:
    """Refuses a prompt whose ``<image>`` placeholders do not match its images one for one (``where`` prefixes
    the message: file and row)."""
    placeholders = count_placeholders(prompt)
    if placeholders != len(entries):
        raise ValueError(f"{where + ': ' if where else ''}{len(entries)} image(s) but {placeholders} '<image>' "
                         f"placeholder(s) in the prompt: each image needs one placeholder where it goes")


def count_placeholders(prompt: Any) -> int:
    """``<image>`` placeholders in a prompt: chat messages' contents, or a plain string."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_PLACEHOLDER)
    return sum(str(message.get("content", "")).count(IMAGE_PLACEHOLDER) for message in prompt or ()
               if isinstance(message, dict))
