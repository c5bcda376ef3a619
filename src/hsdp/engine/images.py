"""Input images for image-to-video and editing pipelines: read, checked and converted on the caller's side.

Images reach the ranks as decoded ``PIL.Image`` objects, so a file that is not an image, is too large or has an
unusable mode fails here, naming the field, before any rank does work.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

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
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
            raise ValueError(f"{field}: not a readable image ({exc})") from exc
    _check_size(image.size, field, max_side)
    mode = _MODES.get(field, "RGB")
    if image.mode != mode:
        try:
            image = image.convert(mode)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{field}: cannot convert mode {image.mode} to {mode} ({exc})") from exc
    return image


def _check_size(size: tuple[int, int], field: str, max_side: int | None) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ValueError(f"{field}: empty image ({width}x{height})")
    if width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{field}: {width}x{height} exceeds {MAX_IMAGE_PIXELS // 2**20} megapixels")
    if max_side is not None and max(width, height) > max_side:
        raise ValueError(f"{field}: {width}x{height} has a side over this server's {max_side} pixels")
