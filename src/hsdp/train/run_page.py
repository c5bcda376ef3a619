"""``<output-dir>/report.html``: the run page ``hsdp train`` writes, readable in a browser with no server.

One HTML file with its curves drawn as inline SVG (no script, no CDN: it opens offline and from a file): loss,
eval loss, learning rate, gradient norm and throughput per step, from the same records as ``--summary-json``
(each point carries its step and value as ``data-step`` / ``data-value``, and the records are embedded as JSON);
the peak memory per rank; the validation samples of each step in a grid (``samples/step-N/``, linked relatively,
so the page and the run folder move together); the checkpoint, the export and the resume command.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import re
from pathlib import Path

__all__ = ["PAGE_NAME", "write_run_page"]

PAGE_NAME = "report.html"
_WIDTH, _HEIGHT, _PAD = 460, 200, 44
_CURVES = (
    ("loss", "Training loss"),
    ("eval_loss", "Eval loss"),
    ("lr", "Learning rate"),
    ("grad_norm", "Gradient norm"),
    ("tokens_per_s", "Throughput"),
)
"""The figures of a :class:`~hsdp.train.trainer.StepResult` drawn, by field: what ``--summary-json`` holds."""
_MEDIA = {".png": "img", ".jpg": "img", ".webp": "img", ".mp4": "video", ".wav": "audio", ".flac": "audio"}
_STYLE = """
body { font: 15px/1.45 system-ui, sans-serif; color: #1b1b1b; background: #fff; margin: 0 auto; max-width: 72rem;
       padding: 1rem; }
h1 { font-size: 1.4rem; } h2 { font-size: 1.1rem; margin-top: 1.5rem; }
.curves { display: flex; flex-wrap: wrap; gap: 1rem; }
figure { margin: 0; } figcaption { font-weight: 600; }
svg { background: #fafafa; border: 1px solid #ccc; }
svg text { font-size: 11px; fill: #333; }
table { border-collapse: collapse; } th, td { border-bottom: 1px solid #ccc; padding: .3rem .6rem; text-align: left; }
.grid img, .grid video { width: 160px; image-rendering: pixelated; }
code { font-size: .9em; }
"""


def _number(value: float) -> str:
    """A value as the page prints it (the exact value is in ``data-value``)."""
    return f"{value:.4g}"


def _curve(name: str, title: str, points: list[tuple[int, float]]) -> str:
    """An SVG line chart of ``points`` (step, value): one circle per point holding its exact step and value."""
    steps = [s for s, _ in points]
    values = [v for _, v in points]
    lo, hi = min(values), max(values)
    span_v = (hi - lo) or abs(hi) or 1.0
    first, last = min(steps), max(steps)
    span_s = (last - first) or 1

    def xy(step: int, value: float) -> tuple[float, float]:
        x = _PAD + (step - first) / span_s * (_WIDTH - 2 * _PAD)
        y = (
            _HEIGHT
            - _PAD
            + (lo - value) / span_v * (_HEIGHT - 2 * _PAD)
            + (0 if hi != lo else -(_HEIGHT / 2 - _PAD))
        )
        return round(x, 2), round(y, 2)

    coords = [xy(s, v) for s, v in points]
    line = " ".join(f"{x},{y}" for x, y in coords)
    dots = "".join(
        f'<circle cx="{x}" cy="{y}" r="3" fill="#0b5cad" data-step="{s}" data-value="{v!r}">'
        f"<title>step {s}: {_number(v)}</title></circle>"
        for (x, y), (s, v) in zip(coords, points, strict=True)
    )
    label = f"{title} per step, from {_number(values[0])} at step {steps[0]} to {_number(values[-1])} at step {steps[-1]}"
    axes = (
        f'<text x="{_PAD}" y="{_HEIGHT - _PAD + 16}">step {first}</text>'
        f'<text x="{_WIDTH - _PAD}" y="{_HEIGHT - _PAD + 16}" text-anchor="end">step {last}</text>'
        f'<text x="4" y="{_PAD - 6}">{_number(hi)}</text>'
        f'<text x="4" y="{_HEIGHT - _PAD + 4}">{_number(lo)}</text>'
    )
    return (
        f'<figure><figcaption id="{name}-title">{html.escape(title)}</figcaption>'
        f'<svg role="img" aria-labelledby="{name}-title" aria-describedby="{name}-desc" data-metric="{name}" '
        f'width="{_WIDTH}" height="{_HEIGHT}" viewBox="0 0 {_WIDTH} {_HEIGHT}"><desc id="{name}-desc">'
        f'{html.escape(label)}</desc>{axes}<polyline points="{line}" fill="none" stroke="#0b5cad" stroke-width="1.5"/>'
        f"{dots}</svg></figure>"
    )


def _step_number(folder: Path) -> int:
    match = re.fullmatch(r"step-(\d+)", folder.name)
    return int(match.group(1)) if match else -1


def _samples(output_dir: Path) -> str:
    """The validation samples grid: a row per step, a column per prompt (file order ``<i>-<prompt>``)."""
    root = output_dir / "samples"
    folders = (
        sorted((f for f in root.glob("step-*") if _step_number(f) >= 0), key=_step_number)
        if root.is_dir()
        else []
    )
    if not folders:
        return "<p>No validation samples (<code>--validation-prompt</code>).</p>"
    rows = []
    for folder in folders:
        cells = []
        for path in sorted(p for p in folder.iterdir() if p.suffix in _MEDIA):
            src = html.escape(path.relative_to(output_dir).as_posix())
            text = html.escape(f"step {_step_number(folder)}: {path.stem}")
            tag = _MEDIA[path.suffix]
            media = (
                f'<img src="{src}" alt="{text}">'
                if tag == "img"
                else f'<{tag} src="{src}" controls aria-label="{text}"></{tag}>'
            )
            cells.append(f"<td>{media}</td>")
        rows.append(
            f'<tr data-step="{_step_number(folder)}"><th scope="row">step {_step_number(folder)}</th>{"".join(cells)}</tr>'
        )
    return f'<table class="grid"><caption>Validation samples per step</caption>{"".join(rows)}</table>'


def _memory(peaks: list[int], kind: str) -> str:
    rows = "".join(f"<tr><td>{rank}</td><td>{peak / 2**20:.0f}</td></tr>" for rank, peak in enumerate(peaks))
    return (
        f"<table><caption>Peak memory per rank ({html.escape(kind or 'bytes')})</caption>"
        f'<tr><th scope="col">rank</th><th scope="col">MiB</th></tr>{rows}</table>'
    )


def write_run_page(output_dir: str | Path, result, cfg) -> Path:
    """Write ``<output_dir>/report.html`` for ``result`` (a :class:`~hsdp.train.trainer.TrainResult`) of the run
    configured by ``cfg`` (a :class:`~hsdp.train.config.TrainConfig`). Atomic (a reader never sees half a page);
    returns its path."""
    output_dir = Path(output_dir)
    steps = result.steps
    records = [dataclasses.asdict(s) for s in steps]
    unit = result.unit or "tokens"
    curves = []
    for name, title in _CURVES:
        points = [(r["step"], float(r[name])) for r in records if r.get(name) is not None]
        if points:
            curves.append(_curve(name, f"{title} ({unit}/s)" if name == "tokens_per_s" else title, points))
    layout = cfg.effective_parallel().describe()
    facts = [("model", cfg.model), ("layout", layout), ("steps", str(steps[-1].step if steps else 0))]
    facts += [
        ("checkpoint", result.checkpoint),
        ("export", result.export),
        ("merged export", result.export_merged),
    ]
    if result.checkpoint:
        facts.append(
            ("resume", "the same command with --resume (the newest complete checkpoint in --output-dir)")
        )
    rows = "".join(
        f'<tr><th scope="row">{k}</th><td><code>{html.escape(str(v))}</code></td></tr>' for k, v in facts if v
    )
    embedded = json.dumps(records).replace("</", "<\\/")  # numbers only; never a closing tag in the script
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>hsdp train: {html.escape(str(cfg.model))}</title><style>{_STYLE}</style></head>
<body><main>
<h1>hsdp train: {html.escape(str(cfg.model))}</h1>
<table><caption>The run</caption>{rows}</table>
<h2>Curves</h2>
<div class="curves">{"".join(curves) or "<p>No steps yet.</p>"}</div>
<h2>Memory</h2>
{_memory(steps[-1].peak_memory, result.memory_kind) if steps else ""}
<h2>Validation samples</h2>
{_samples(output_dir)}
<script type="application/json" id="records">{embedded}</script>
</main></body></html>
"""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / PAGE_NAME
    tmp = path.with_name(f".{PAGE_NAME}.tmp")
    tmp.write_text(page)
    os.replace(tmp, path)
    return path
