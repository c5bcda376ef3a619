"""``<output-dir>/report.html``: the run page ``hsdp train`` writes, readable in a browser with no server.

One HTML file with its curves drawn as inline SVG (no library, no CDN: it opens offline and from a file): loss,
eval loss, learning rate, gradient norm, throughput and peak memory per rank per step, from the same records as
``--summary-json`` (each point carries its step and value as ``data-step`` / ``data-value``, and the records are
embedded as JSON); the data table (items, size buckets, files left out with why); the validation samples of each
step in a grid (``samples/step-N/``, linked relatively, so the page and the run folder move together); the
checkpoint, the export and the resume command.

Rank 0 rewrites it (atomically: a reader never sees half a page) when the run starts, at each eval, validation
and checkpoint point, and at log points at most every ``PAGE_EVERY_S`` (:mod:`hsdp.train.trainer`). While the run goes the page says so and reloads itself (a few lines of inline
script, with a box to turn it off); the page of a finished, stopped or failed run has no script and stays still.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import re
import time
from pathlib import Path

__all__ = ["PAGE_NAME", "end_live_page", "refresh_seconds", "write_run_page"]

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
#state { padding: .5rem .8rem; border-left: 4px solid #0b5cad; background: #eef4fb; }
#state[data-state=failed] { border-color: #a40000; background: #fbeeee; }
"""
_COLOURS = ("#0b5cad", "#b34700", "#2e7d32", "#6a1b9a", "#00695c", "#ad1457", "#4e342e", "#37474f")
"""One per rank on the memory chart (cycled past eight)."""
_STALE_S = 3600
"""A live page stops reloading itself when it has not been rewritten for this long: a run killed without a word
(SIGKILL, a lost node) never writes its last page."""


def _number(value: float) -> str:
    """A value as the page prints it (the exact value is in ``data-value``)."""
    return f"{value:.4g}"


def _curve(
    name: str, title: str, series: list[tuple[str, list[tuple[int, float]]]], scale: float = 1.0
) -> str:
    """An SVG line chart of ``series`` ((label, [(step, value)])): one circle per point holding its exact step and
    value (and its series as ``data-series`` when there are several); drawn and labelled as ``value / scale``."""
    drawn = [v / scale for _, points in series for _, v in points]
    steps = [s for _, points in series for s, _ in points]
    lo, hi = min(drawn), max(drawn)
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

    lines, labels = [], []
    for index, (label, points) in enumerate(series):
        colour = _COLOURS[index % len(_COLOURS)]
        coords = [xy(s, v / scale) for s, v in points]
        tag = f' data-series="{html.escape(label)}"' if len(series) > 1 else ""
        lines.append(
            f'<polyline points="{" ".join(f"{x},{y}" for x, y in coords)}" fill="none" stroke="{colour}" '
            f'stroke-width="1.5"/>'
            + "".join(
                f'<circle cx="{x}" cy="{y}" r="3" fill="{colour}" data-step="{s}" data-value="{v!r}"{tag}>'
                f"<title>{html.escape(label)} step {s}: {_number(v / scale)}</title></circle>"
                for (x, y), (s, v) in zip(coords, points, strict=True)
            )
        )
        labels.append(
            f"{label} from {_number(points[0][1] / scale)} at step {points[0][0]} to "
            f"{_number(points[-1][1] / scale)} at step {points[-1][0]}"
        )
    legend = (
        "".join(
            f'<text x="{_WIDTH - _PAD}" y="{14 + 13 * i}" text-anchor="end" fill="{_COLOURS[i % len(_COLOURS)]}">'
            f"{html.escape(label)}</text>"
            for i, (label, _) in enumerate(series)
        )
        if len(series) > 1
        else ""
    )
    axes = (
        f'<text x="{_PAD}" y="{_HEIGHT - _PAD + 16}">step {first}</text>'
        f'<text x="{_WIDTH - _PAD}" y="{_HEIGHT - _PAD + 16}" text-anchor="end">step {last}</text>'
        f'<text x="4" y="{_PAD - 6}">{_number(hi)}</text>'
        f'<text x="4" y="{_HEIGHT - _PAD + 4}">{_number(lo)}</text>'
    )
    desc = f"{title} per step: {'; '.join(labels)}"
    return (
        f'<figure><figcaption id="{name}-title">{html.escape(title)}</figcaption>'
        f'<svg role="img" aria-labelledby="{name}-title" aria-describedby="{name}-desc" data-metric="{name}" '
        f'width="{_WIDTH}" height="{_HEIGHT}" viewBox="0 0 {_WIDTH} {_HEIGHT}"><desc id="{name}-desc">'
        f"{html.escape(desc)}</desc>{axes}{legend}{''.join(lines)}</svg></figure>"
    )


def _curves(records: list[dict], unit: str, memory_kind: str) -> str:
    """Every figure of the records that has a point, and the peak memory of each rank (MiB drawn, bytes kept)."""
    out = []
    for name, title in _CURVES:
        points = [(r["step"], float(r[name])) for r in records if r.get(name) is not None]
        if points:
            out.append(
                _curve(name, f"{title} ({unit}/s)" if name == "tokens_per_s" else title, [(title, points)])
            )
    ranks = max((len(r["peak_memory"]) for r in records), default=0)
    if ranks:
        series = [
            (
                f"rank {rank}",
                [(r["step"], float(r["peak_memory"][rank])) for r in records if len(r["peak_memory"]) > rank],
            )
            for rank in range(ranks)
        ]
        title = f"Peak memory per rank (MiB, {memory_kind or 'bytes'})"
        out.append(_curve("peak_memory", title, series, scale=2**20))
    return "".join(out)


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


def _data(table: dict | None) -> str:
    """The data table (:meth:`hsdp.train.trainer.Trainer.data_table`): what the run trains on, and what it left out."""
    if not table:
        return "<p>Not read yet.</p>"
    rows = [
        ("source", table.get("source", "")),
        ("items", f"{table['items']} {table.get('unit', '')}".strip()),
    ]
    rows += [(f"bucket {label}", f"{count} items") for label, count in table.get("buckets", [])]
    body = "".join(
        f'<tr><th scope="row">{html.escape(k)}</th><td data-field="{html.escape(k)}">{html.escape(str(v))}</td></tr>'
        for k, v in rows
    )
    out = f'<table id="data"><caption>What the run trains on</caption>{body}</table>'
    notes = [("skipped", path, why) for path, why in table.get("skipped", [])]
    notes += [("upscaled", path, why) for path, why in table.get("upscaled", [])]
    if notes:
        listed = "".join(
            f'<tr data-kind="{kind}"><td>{kind}</td><td><code>{html.escape(str(path))}</code></td>'
            f"<td>{html.escape(why)}</td></tr>"
            for kind, path, why in notes
        )
        out += (
            '<table id="left-out"><caption>Files left out or changed, with why</caption><tr><th scope="col">what</th>'
            f'<th scope="col">file</th><th scope="col">why</th></tr>{listed}</table>'
        )
    return out


def refresh_seconds(records: list[dict], log_every: int) -> int:
    """How often a live page reloads itself: about one log interval (the last step's time x ``log_every``),
    between 2 and 30 seconds."""
    last = records[-1]["seconds"] if records else 1.0
    return int(min(30, max(2, round(last * max(1, log_every)))))


_RELOAD = """(() => {
  const box = document.getElementById("auto-refresh"), key = "hsdp-run-page-refresh";
  try { if (sessionStorage.getItem(key) === "off") box.checked = false; } catch (e) {}
  box.addEventListener("change", () => { try { sessionStorage.setItem(key, box.checked ? "on" : "off"); } catch (e) {} });
  const body = document.body, written = Number(body.dataset.written) * 1000;
  setTimeout(() => {
    if (!box.checked) return;
    if (Date.now() - written > STALE * 1000) {
      document.getElementById("state-text").textContent +=
        " No news from the run for a long while: it may have ended without writing its last page.";
      return;
    }
    location.reload();
  }, Number(body.dataset.refresh) * 1000);
})();"""


def _state_kind(state: str) -> str:
    """``running``, ``finished``, ``stopped`` or ``failed``: the page's ``data-state``."""
    return state.split(":")[0].split(" ")[0]


def _state(state: str, done: int, cfg, refresh: int) -> str:
    """The line that says where the run is; a live page adds its reload box and script."""
    text = {
        "running": f"Running: step {done} of {cfg.steps}.",
        "finished": f"Finished at step {done} of {cfg.steps}.",
    }.get(state, f"{state[:1].upper()}{state[1:]} (step {done} of {cfg.steps}).")
    line = (
        f'<p id="state" role="status" data-state="{html.escape(_state_kind(state))}">'
        f'<span id="state-text">{html.escape(text)}</span>'
    )
    if state != "running":
        return line + "</p>"
    return (
        line
        + f' <label><input type="checkbox" id="auto-refresh" checked> reload this page every {refresh} s '
        "while the run goes</label></p>" + f"<script>{_RELOAD.replace('STALE', str(_STALE_S))}</script>"
    )


def _json(value) -> str:
    """JSON for a ``<script type="application/json">``: never a closing tag inside."""
    return json.dumps(value).replace("</", "<\\/")


def write_run_page(
    output_dir: str | Path, result, cfg, *, state: str = "finished", checkpoint: str | None = None
) -> Path:
    """Write ``<output_dir>/report.html`` for ``result`` (a :class:`~hsdp.train.trainer.TrainResult`, so far) of
    the run configured by ``cfg`` (a :class:`~hsdp.train.config.TrainConfig`). ``state``: ``running`` (the page
    reloads itself), ``finished``, or what ended the run (``stopped by SIGTERM``, ``failed: ...``).
    ``checkpoint``: the newest complete one while the run goes (``result.checkpoint`` is set at the end). Atomic
    (a reader never sees half a page); returns its path."""
    run = {
        "unit": result.unit or "tokens",
        "memory_kind": result.memory_kind,
        "data": result.data,
        "checkpoint": result.checkpoint or checkpoint,
        "export": result.export,
        "export_merged": result.export_merged,
    }
    return _write(Path(output_dir), [dataclasses.asdict(s) for s in result.steps], run, cfg, state)


def _write(output_dir: Path, records: list[dict], run: dict, cfg, state: str) -> Path:
    done = records[-1]["step"] if records else 0
    layout = cfg.effective_parallel().describe()
    facts = [("model", cfg.model), ("layout", layout), ("steps", f"{done} of {cfg.steps}")]
    facts += [
        ("checkpoint", run["checkpoint"]),
        ("export", run["export"]),
        ("merged export", run["export_merged"]),
    ]
    if run["checkpoint"]:
        facts.append(
            ("resume", "the same command with --resume (the newest complete checkpoint in --output-dir)")
        )
    rows = "".join(
        f'<tr><th scope="row">{k}</th><td><code>{html.escape(str(v))}</code></td></tr>' for k, v in facts if v
    )
    refresh = refresh_seconds(records, cfg.log_every)
    memory = _memory(records[-1]["peak_memory"], run["memory_kind"]) if records else "<p>No steps yet.</p>"
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>hsdp train: {html.escape(str(cfg.model))}</title><style>{_STYLE}</style></head>
<body data-state="{html.escape(_state_kind(state))}" data-written="{time.time():.0f}" data-refresh="{refresh}">
<main>
<h1>hsdp train: {html.escape(str(cfg.model))}</h1>
{_state(state, done, cfg, refresh)}
<table><caption>The run</caption>{rows}</table>
<h2>Curves</h2>
<div class="curves">{_curves(records, run["unit"], run["memory_kind"]) or "<p>No steps yet.</p>"}</div>
<h2>Memory</h2>
{memory}
<h2>Data</h2>
{_data(run["data"])}
<h2>Validation samples</h2>
{_samples(output_dir)}
<script type="application/json" id="records">{_json(records)}</script>
<script type="application/json" id="run">{_json(run)}</script>
</main></body></html>
"""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / PAGE_NAME
    tmp = path.with_name(f".{PAGE_NAME}.tmp")
    tmp.write_text(page)
    os.replace(tmp, path)
    return path


def end_live_page(output_dir: str | Path, cfg, state: str, *, since: float = 0.0) -> bool:
    """Rewrite a page that still says the run goes (its ranks ended without writing their last one: killed) as
    ended with ``state``, from the records and facts it embeds. False when there is no such page written at or
    after ``since`` (a page of a run before this one is left as it is)."""
    path = Path(output_dir) / PAGE_NAME
    try:
        if path.stat().st_mtime < since:
            return False
        text = path.read_text()
    except OSError:
        return False
    if '<body data-state="running"' not in text:
        return False
    embedded = {
        key: json.loads(match.group(1))
        for key in ("records", "run")
        if (match := re.search(rf'<script type="application/json" id="{key}">(.*?)</script>', text, re.S))
    }
    if "run" not in embedded:
        return False  # a page of another version: left as it is
    _write(Path(output_dir), embedded.get("records", []), embedded["run"], cfg, state)
    return True
