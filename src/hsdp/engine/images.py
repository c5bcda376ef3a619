"""Input images for image-to-video and editing pipelines: read, checked and converted on the caller's side.

Images reach the ranks as decoded ``PIL.Image`` objects, so a file that is not an image, is too large or has an
unusable mode fails here, naming the field, before any rank does work.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

from hsdp.file_kinds import describe_bytes

__all__ = ["load_image", "ImageInput", "MAX_IMAGE_PIXELS"]

ImageInput = Any
"""A ``PIL.Image.Image``, a path to an image file, or the file's bytes."""

MAX_IMAGE_PIXELS = 64 * 2**20
"""Refuse larger inputs (64 megapixels): far beyond any pipeline's working size, and a decompression bomb guard."""

_MODES = {"image": "RGB", "mask_image": "L"}


def load_image(value: ImageInput, field: str, *, max_side: int | None = None):
    """``value`` as a PIL image in the mode its field needs (RGB; masks: L). Raises ``ValueError`` naming
    ``field``: not an image, too many pixels, a side over ``max_side``, or a mode that cannot be converted."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        image = value
    else:
        if isinstance(value, (str, os.PathLike)):
            path = Path(value)
            if not path.is_file():
                raise ValueError(f"{field}: no such file {path}")
            data = path.read_bytes()
        elif isinstance(value, (bytes, bytearray)):
            data = bytes(value)
        else:
            raise ValueError(f"{field}: expected an image, a path or bytes, got {type(value).__name__}")
        try:
            image = Image.open(io.BytesIO(data))
            _check_size(image.size, field, max_side)  # from the header, before decoding the pixels
            image.load()
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(_unreadable(field, value, data, exc)) from exc
        except Image.DecompressionBombError as exc:
            raise ValueError(f"{field}: not a readable image ({exc})") from exc
    _check_size(image.size, field, max_side)
    mode = _MODES.get(field, "RGB")
    if image.mode != mode:
        try:
            image = image.convert(mode)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{field}: cannot convert mode {image.mode} to {mode} ({exc})") from exc
    return image


def _unreadable(field: str, value: ImageInput, data: bytes, exc: Exception) -> str:
    """What the data is and what was expected: PIL's own message names only its ``BytesIO`` object (``cannot
    identify image file <_io.BytesIO object at 0x...>``), or a format it guessed from two bytes."""
    what = describe_bytes(data[:4096]) + (f" ({value})" if isinstance(value, (str, os.PathLike)) else "")
    if what.split(" (")[0].endswith("image"):  # the right kind, but damaged or in a mode PIL does not read
        return f"{field}: not a readable image: {what} that PIL cannot decode ({exc})"
    return f"{field}: {what}, not a readable image; pass a PNG, JPEG or WebP image (any format PIL reads)"


def _check_size(size: tuple[int, int], field: str, max_side: int | None) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ValueError(f"{field}: empty image ({width}x{height})")
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{field}: {width}x{height} exceeds {MAX_IMAGE_PIXELS // 2**20} megapixels")
    if max_side is not None and max(width, height) > max_side:
        raise ValueError(f"{field}: {width}x{height} has a side over this server's {max_side} pixels")
