"""``GET /metrics`` in the Prometheus text exposition format (version 0.0.4), written by hand: a dozen series
do not justify a client library, and every value is read at scrape time from the store and the runner."""

from __future__ import annotations

from hsdp.serve.jobs import FINISHED, JobStore
from hsdp.serve.runner import RunnerStats

__all__ = ["render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_STATES = ("starting", "ready", "restarting", "stopped", "dead")


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(
        self, name: str, kind: str, help_text: str, samples: list[tuple[dict, float]], suffixes=("",)
    ) -> None:
        """One metric family; a summary passes ``suffixes=("_sum", "_count")`` and one value per suffix."""
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for (labels, value), suffix in zip(samples, suffixes * len(samples), strict=False):
            rendered = "{" + ",".join(f'{k}="{_label(v)}"' for k, v in labels.items()) + "}" if labels else ""
            self.lines.append(
                f"{name}{suffix}{rendered} {value:g}"
                if isinstance(value, float)
                else f"{name}{suffix}{rendered} {value}"
            )


def render_metrics(
    model: str,
    store: JobStore,
    stats: RunnerStats,
    loads: dict[str, int] | None = None,
    quantized: dict | None = None,
) -> str:
    """``loads``: the server's ``base_loads`` and LoRA adapter ``loads``, ``switches`` and ``evictions``;
    ``quantized``: the engine's :attr:`hsdp.engine.Engine.quantized` (with ``--weight-dtype``), so a layout whose
    rows do not divide by the shard size shows how much of the weights actually stayed in 8 bits."""
    w = _Writer()
    m = {"model": model}
    w.metric("hsdp_queue_depth", "gauge", "Jobs waiting for the engine.", [(m, store.depth())])
    w.metric("hsdp_queue_capacity", "gauge", "Most jobs that may wait (then 429).", [(m, store.capacity)])
    w.metric(
        "hsdp_jobs",
        "gauge",
        "Jobs by state: queued and in_progress now, finished states counted since the server started.",
        [({**m, "state": "queued"}, store.depth()), ({**m, "state": "in_progress"}, store.running())]
        + [({**m, "state": s}, store.finished_counts[s]) for s in FINISHED],
    )
    w.metric(
        "hsdp_step_seconds",
        "summary",
        "Seconds per denoising step (diffusion) or per generated token (causal LM).",
        [(m, stats.step_seconds_sum), (m, stats.step_count)],
        suffixes=("_sum", "_count"),
    )
    w.metric(
        "hsdp_job_seconds",
        "summary",
        "Engine seconds per finished request (as measured on its rank).",
        [(m, stats.job_seconds_sum), (m, stats.job_count)],
        suffixes=("_sum", "_count"),
    )
    w.metric(
        "hsdp_rank_peak_memory_bytes",
        "gauge",
        "Peak memory of each rank during the last engine call (accelerator allocated, or RSS on CPU).",
        [({**m, "rank": r, "kind": stats.memory_kind}, b) for r, b in enumerate(stats.peak_memory_bytes)],
    )
    w.metric("hsdp_batches_total", "counter", "Engine calls.", [(m, stats.batches)])
    w.metric(
        "hsdp_batched_requests_total",
        "counter",
        "Requests run in engine calls.",
        [(m, stats.batched_requests)],
    )
    w.metric(
        "hsdp_padded_requests_total",
        "counter",
        "Padding requests (request-parallel slots left empty).",
        [(m, stats.padded_requests)],
    )
    w.metric(
        "hsdp_engine_restarts_total",
        "counter",
        "Times the workers were started again after a failure.",
        [(m, stats.restarts)],
    )
    w.metric(
        "hsdp_worker_failures_total",
        "counter",
        "Dead or hung workers noticed, while idle (heartbeat) or during a call (sentinel, step timeout).",
        [(m, stats.worker_failures)],
    )
    w.metric(
        "hsdp_engine_thread_errors_total",
        "counter",
        "Errors of the engine thread outside engine calls; each failed the running batch, the thread went on.",
        [(m, stats.thread_errors)],
    )
    w.metric(
        "hsdp_record_write_errors_total",
        "counter",
        "Job records that could not be written (e.g. a full disk); the job went on in memory.",
        [(m, store.write_errors)],
    )
    w.metric(
        "hsdp_job_retries_total",
        "counter",
        "Jobs queued again after their run was interrupted (worker failure or server restart).",
        [(m, store.requeued)],
    )
    w.metric(
        "hsdp_generated_tokens_total",
        "counter",
        "Tokens produced by the engine.",
        [(m, stats.generated_tokens)],
    )
    w.metric(
        "hsdp_time_to_first_token_seconds",
        "summary",
        "From a text request's arrival to its first token.",
        [(m, stats.ttft_seconds_sum), (m, stats.ttft_count)],
        suffixes=("_sum", "_count"),
    )
    if loads is not None:
        w.metric(
            "hsdp_base_loads_total",
            "counter",
            "Times the base model was loaded (engine starts).",
            [(m, loads["base_loads"])],
        )
        for name, help_text in (
            ("loads", "LoRA adapters copied into a slot on the ranks."),
            ("switches", "Engine calls whose adapter (or the base) differs from the previous call's."),
            ("evictions", "Adapters evicted from their slot (least recently used) for another."),
        ):
            w.metric(f"hsdp_adapter_{name}_total", "counter", help_text, [(m, loads[name])])
    if quantized is not None:
        w.metric(
            "hsdp_quantized_weight_fraction",
            "gauge",
            "Fraction of the nn.Linear weight elements stored in 8 bits (--weight-dtype; the rest kept the dtype).",
            [(m, float(quantized["quantized_fraction"]))],
        )
        w.metric(
            "hsdp_linear_weights",
            "gauge",
            "nn.Linear weights of the loaded components, by how they are stored.",
            [
                ({**m, "stored": "8bit"}, quantized["quantized_weights"]),
                ({**m, "stored": "dtype"}, quantized["linear_weights"] - quantized["quantized_weights"]),
            ],
        )
    w.metric(
        "hsdp_engine_state",
        "gauge",
        "1 for the engine's current state.",
        [({**m, "state": s}, int(stats.state == s)) for s in _STATES],
    )
    w.metric(
        "hsdp_worker_info",
        "gauge",
        "The current worker processes (rank, pid).",
        [({**m, "rank": r, "pid": p}, 1) for r, p in enumerate(stats.worker_pids)],
    )
    return "\n".join(w.lines) + "\n"
