"""What a file is, from its first bytes: the words a message uses when a flag gets the wrong kind of file ("a PNG
image", "a text file", "a safetensors file") instead of the reader's own failure (PIL's ``cannot identify image file
<_io.BytesIO object at 0x...>``, or "no such folder" for a file that exists)."""

from __future__ import annotations

import struct
from pathlib import Path

__all__ = ["describe", "describe_bytes", "is_safetensors"]

_MAGIC: tuple[tuple[int, bytes, str], ...] = (
    # (offset, bytes, what): the formats a user is likely to pass by mistake
    (0, b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (0, b"\xff\xd8\xff", "a JPEG image"),
    (0, b"GIF8", "a GIF image"),
    (0, b"BM", "a BMP image"),
    (0, b"II*\x00", "a TIFF image"),
    (0, b"MM\x00*", "a TIFF image"),
    (8, b"WEBP", "a WebP image"),
    (8, b"WAVE", "a WAV audio file"),
    (8, b"AVI ", "an AVI video"),
    (4, b"ftyp", "an MP4 / MOV video"),
    (0, b"\x1a\x45\xdf\xa3", "a Matroska / WebM video"),
    (0, b"fLaC", "a FLAC audio file"),
    (0, b"OggS", "an Ogg audio file"),
    (0, b"ID3", "an MP3 audio file"),
    (0, b"%PDF", "a PDF document"),
    (0, b"GGUF", "a GGUF model file"),
    (0, b"PK\x03\x04", "a zip archive (or a PyTorch .pt / .bin checkpoint)"),
    (0, b"\x1f\x8b", "a gzip archive"),
    (0, b"\x80\x02", "a pickle (a PyTorch checkpoint of the old format)"),
)


def is_safetensors(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes, 4 KiB or more) starts a safetensors file: an 8-byte little-endian
    header length, then a JSON object."""
    if len(head) < 10:
        return False
    (length,) = struct.unpack("<Q", head[:8])
    return 2 <= length <= 100 * 2**20 and head[8:9] == b"{"


def describe_bytes(head: bytes) -> str:
    """What the data starting with ``head`` is, in a few words."""
    if not head:
        return "an empty file"
    if is_safetensors(head):
        return "a safetensors file"
    for offset, magic, what in _MAGIC:
        if head[offset : offset + len(magic)] == magic:
            return what
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the end of the head
            return f"a binary file (starting {head[:8].hex(' ')})"
        text = head[: exc.start].decode("utf-8")
    if "\x00" in text:
        return f"a binary file (starting {head[:8].hex(' ')})"
    if text.lstrip()[:1] in ("{", "["):
        return "a JSON file"
    return "a text file"


def describe(path: str | Path) -> str:
    """What ``path`` is: a folder, a missing path, or :func:`describe_bytes` of its first 4 KiB."""
    path = Path(path)
    if path.is_dir():
        return "a folder"
    if not path.exists():
        return "no such file or folder"
    with path.open("rb") as f:
        return describe_bytes(f.read(4096))
