"""``hsdp plan`` as a picture: the memory per rank of each layout as a bar chart, in the terminal (under the table)
and as a file (``--plot FILE``: ``.svg`` written directly, ``.png`` drawn with Pillow), one bar per layout: its
``total`` (the table's column), against the usable memory per device. A bar that fits is blue, the recommended one
is marked ``*``, one that does not fit is grey and crosses the usable line.

The SVG holds each bar's exact bytes (``data-layout`` / ``data-bytes`` / ``data-fits``); the PNG holds them in its
``hsdp-plan`` text chunk (JSON), so a script (or a test) reads the numbers the picture draws.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

from hsdp.planning.profile import PlanError, format_size

__all__ = ["PLOT_SUFFIXES", "bars", "check_plot_path", "terminal_chart", "write_plot"]

PLOT_SUFFIXES = (".svg", ".png")
_FITS, _RECOMMENDED, _NO = "#3b6fb6", "#0b3d91", "#9e9e9e"
_ROW, _LABEL, _CHART, _VALUE, _TOP = 22, 230, 420, 110, 40


def bars(result) -> list[dict]:
    """One bar per layout of a :class:`~hsdp.planning.search.Plan`, in the table's order."""
    return [
        {"layout": e.layout.label, "bytes": e.total, "fits": e.fits, "recommended": e is result.recommended}
        for e in result.estimates
    ]


def _scale(result) -> int:
    return max([b["bytes"] for b in bars(result)] + [result.hardware.device_memory]) or 1


def terminal_chart(result, width: int = 40) -> str:
    """The bars in text: ``#`` fits, ``x`` does not, ``|`` the usable memory per device."""
    top = _scale(result)
    usable = round(result.hardware.device_memory / top * width)
    wide = max(len(b["layout"]) for b in bars(result)) + 3  # and " *" for the recommended one
    lines = [f"memory per rank ('|' = {format_size(result.hardware.device_memory)} usable per device)"]
    for b in bars(result):
        filled = round(b["bytes"] / top * width)
        cells = [("#" if b["fits"] else "x") if i < filled else " " for i in range(max(width, usable + 1))]
        cells[usable] = "|"
        mark = " *" if b["recommended"] else ""
        lines.append(f"{(b['layout'] + mark).ljust(wide)}{''.join(cells)} {format_size(b['bytes'])}")
    return "\n".join(lines)


def _svg(result, title: str) -> str:
    top = _scale(result)
    rows = bars(result)
    width, height = _LABEL + _CHART + _VALUE, _TOP + _ROW * len(rows) + 30
    usable_x = _LABEL + result.hardware.device_memory / top * _CHART
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-labelledby="title" font-family="sans-serif" font-size="12">',
        f'<title id="title">{html.escape(title)}</title>',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="8" y="20" font-size="14" font-weight="bold">{html.escape(title)}</text>',
    ]
    for i, b in enumerate(rows):
        y = _TOP + i * _ROW
        colour = _RECOMMENDED if b["recommended"] else _FITS if b["fits"] else _NO
        length = round(b["bytes"] / top * _CHART, 2)
        label = b["layout"] + (" *" if b["recommended"] else "")
        out.append(f'<text x="{_LABEL - 8}" y="{y + 15}" text-anchor="end">{html.escape(label)}</text>')
        out.append(
            f'<rect class="bar" x="{_LABEL}" y="{y + 3}" width="{length}" height="{_ROW - 6}" fill="{colour}" '
            f'data-layout="{html.escape(b["layout"])}" data-bytes="{b["bytes"]}" data-fits="{str(b["fits"]).lower()}">'
            f"<title>{html.escape(b['layout'])}: {format_size(b['bytes'])} per rank</title></rect>"
        )
        out.append(f'<text x="{_LABEL + length + 6}" y="{y + 15}">{format_size(b["bytes"])}</text>')
    bottom = _TOP + _ROW * len(rows)
    out.append(
        f'<line x1="{usable_x:.2f}" y1="{_TOP - 4}" x2="{usable_x:.2f}" y2="{bottom + 4}" stroke="#a40000" '
        'stroke-dasharray="4 3"/>'
    )
    out.append(
        f'<text x="{usable_x:.2f}" y="{bottom + 20}" text-anchor="middle" fill="#a40000">'
        f"{format_size(result.hardware.device_memory)} usable per device</text>"
    )
    return "\n".join(out) + "\n</svg>\n"


def _png(result, path: Path, title: str) -> None:
    try:
        from PIL import Image, ImageDraw, PngImagePlugin
    except ImportError as exc:
        raise PlanError(
            f"--plot {path}: a PNG needs Pillow (pip install pillow); or name a .svg file"
        ) from exc
    top = _scale(result)
    rows = bars(result)
    width, height = _LABEL + _CHART + _VALUE, _TOP + _ROW * len(rows) + 30
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((8, 8), title, fill="black")
    for i, b in enumerate(rows):
        y = _TOP + i * _ROW
        colour = _RECOMMENDED if b["recommended"] else _FITS if b["fits"] else _NO
        length = max(1, round(b["bytes"] / top * _CHART))
        label = b["layout"] + (" *" if b["recommended"] else "")
        draw.text((_LABEL - 8 - draw.textlength(label), y + 5), label, fill="black")
        draw.rectangle((_LABEL, y + 3, _LABEL + length - 1, y + _ROW - 4), fill=colour)
        draw.text((_LABEL + length + 6, y + 5), format_size(b["bytes"]), fill="black")
    usable_x = round(_LABEL + result.hardware.device_memory / top * _CHART)
    draw.line((usable_x, _TOP - 4, usable_x, _TOP + _ROW * len(rows) + 4), fill="#a40000")
    usable = f"{format_size(result.hardware.device_memory)} usable per device"
    draw.text((usable_x - draw.textlength(usable) / 2, _TOP + _ROW * len(rows) + 10), usable, fill="#a40000")
    info = PngImagePlugin.PngInfo()
    info.add_text("hsdp-plan", json.dumps(rows))
    image.save(path, pnginfo=info)


def check_plot_path(path: str | Path) -> None:
    """Refuse a ``--plot`` name before planning: a known suffix, in a folder that exists."""
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise PlanError(f"--plot {path}: name a .svg or .png file (the suffix chooses the format)")
    if not path.parent.is_dir():
        raise PlanError(f"--plot {path}: the folder {path.parent} does not exist; create it or name another")


def write_plot(result, path: str | Path, title: str) -> Path:
    """``--plot FILE``: the bar chart as ``.svg`` or ``.png`` (by the name's suffix)."""
    path = Path(path)
    check_plot_path(path)
    if path.suffix.lower() == ".svg":
        path.write_text(_svg(result, title))
    else:
        _png(result, path, title)
    return path
