"""``hsdp train --serve-report PORT``: the run page and its samples over HTTP while the run goes.

A standard-library ``ThreadingHTTPServer`` in a child process forked from the one that starts the run (rank 0's):
not a thread of it, since a thread there would make the ranks start by the forkserver, importing torch and the
model's library again, instead of forking (:func:`hsdp.launch.fork_problem`). Bound to ``--serve-report-host`` (default ``127.0.0.1``: this machine only; ``0.0.0.0`` for the network, with no
authentication). It answers ``/`` and ``/report.html`` with ``<output-dir>/report.html`` (a short page that
reloads itself until the run writes its first one: an older page is a previous run's) and ``/samples/...`` with the validation samples; every
other path, checkpoints included, is a 404. It stops when the run ends.
"""

from __future__ import annotations

import contextlib
import gc
import http.server
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from hsdp.train.run_page import PAGE_NAME

__all__ = ["serve_run_page"]

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".webp": "image/webp",
    ".mp4": "video/mp4",
    ".wav": "audio/wav",
    ".flac": "audio/flac",
}
_WAITING = b"""<!doctype html><html lang="en"><head><meta charset="utf-8"><title>hsdp train: starting</title></head>
<body><main><h1>hsdp train</h1><p role="status">The run is starting; this page reloads itself until its page is
written.</p><script>setTimeout(() => location.reload(), 2000);</script></main></body></html>"""


def _handler(folder: Path, since: float) -> type[http.server.BaseHTTPRequestHandler]:
    root = folder.resolve()

    class RunPage(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            body, kind = self._file(unquote(urlsplit(self.path).path))
            if body is None:
                self.send_error(404, "the run page serves / and /samples/ only")
                return
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")  # the page changes under the same name
            self.end_headers()
            self.wfile.write(body)

        def _file(self, path: str) -> tuple[bytes | None, str]:
            if path in ("/", f"/{PAGE_NAME}"):
                page = root / PAGE_NAME
                ours = page.is_file() and page.stat().st_mtime >= since
                return (page.read_bytes() if ours else _WAITING), _TYPES[".html"]
            target = (root / path.lstrip("/")).resolve()
            inside = target.is_relative_to(root / "samples")  # never a checkpoint, nor outside the folder
            if not (path.startswith("/samples/") and inside and target.is_file() and target.suffix in _TYPES):
                return None, ""
            return target.read_bytes(), _TYPES[target.suffix]

        def log_message(self, format: str, *args) -> None:  # noqa: A002 (the stdlib's name)
            pass  # the run's log is the training's

    return RunPage


@contextlib.contextmanager
def serve_run_page(folder: str | Path, port: int, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``folder``'s run page on ``host:port`` (0: a free port) for the ``with`` block; yields its URL. The
    socket is bound here (a taken port raises ``OSError`` at once); a forked child serves it on Linux, a daemon
    thread elsewhere (macOS's system libraries are not fork-safe)."""
    server = _RunPageServer((host, port), _handler(Path(folder), time.time() - 1))  # file times are coarser
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{server.server_address[1]}/"
    if sys.platform != "linux":
        with _served_by_thread(server):
            yield url
        return
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _serve_in_child(server, parent)
    server.server_close()  # the child holds the socket now
    try:
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGTERM)
        os.waitpid(child, 0)


class _RunPageServer(http.server.ThreadingHTTPServer):
    daemon_threads = True
    parent: int | None = None

    def service_actions(self) -> None:
        """Twice a second: a child whose parent died (SIGKILL, the OOM killer) stops serving."""
        if self.parent is not None and os.getppid() != self.parent:
            os._exit(0)


def _serve_in_child(server: _RunPageServer, parent: int) -> None:
    """The forked child: serve until the parent stops it (SIGTERM) or dies; never run the parent's exit handlers."""
    try:
        gc.freeze()  # the parent's uncollected garbage (stores, process groups) is not the child's to free
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the parent decides, then stops it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        server.parent = parent
        server.serve_forever(poll_interval=0.5)
    finally:
        os._exit(0)


@contextlib.contextmanager
def _served_by_thread(server: _RunPageServer) -> Iterator[None]:
    thread = threading.Thread(target=server.serve_forever, name="hsdp-run-page", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
