"""A minimal Hugging Face Hub on 127.0.0.1 for the download tests (ours: no maintained package serving a local
repository is installed here). It answers the endpoints ``huggingface_hub`` calls for ``snapshot_download``,
``hf_hub_download``, ``model_info`` and the safetensors-header reads, for one repository held in memory:

- ``GET /api/models/{repo}[/revision/{rev}]``: ``sha`` and ``siblings``;
- ``GET /api/models/{repo}/tree/{rev}``: the file listing;
- ``HEAD`` / ``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag``, ``Content-Length``, ``Range``;
- the hub's ``X-Error-Code`` answers: 401 ``RepoNotFound`` (private, no token), 403 ``GatedRepo``, 404
  ``RevisionNotFound`` / ``EntryNotFound``.

Every request is recorded (``requests``: method, path, Range header) so a test can count what was fetched.
``cut_once``: files whose first GET sends half its bytes and drops the connection (a killed download).
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class LocalHub:
    """``with LocalHub(repo_id, folder) as hub``: serves ``folder``'s files as ``repo_id`` at ``hub.endpoint``."""

    def __init__(self, repo_id: str, folder: Path, *, token: str | None = None, gated: bool = False) -> None:
        self.repo_id, self.token, self.gated = repo_id, token, gated
        self.files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        self.requests: list[tuple[str, str, str | None]] = []
        self.cut_once: set[str] = set()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> LocalHub:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloads(self, path: str) -> int:
        """GETs of ``path``'s bytes (not its HEAD metadata)."""
        return sum(1 for method, p, _ in self.requests if method == "GET" and p.endswith(f"/resolve/{COMMIT}/{path}"))


def _handler(hub: LocalHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes: with Nagle's algorithm on, each answer after the first on a
        # kept-alive connection waited ~40 ms for the client's delayed ACK between them (as hsdp serve's did).
        disable_nagle_algorithm = True

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:  # noqa: N802 (http.server's name)
            self._answer(head=True)

        def do_GET(self) -> None:  # noqa: N802
            self._answer(head=False)

        def _answer(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            with hub._lock:
                hub.requests.append((self.command, path, self.headers.get("Range")))
            repo = hub.repo_id
            if path.startswith(f"/api/models/{repo}"):
                rest = path[len(f"/api/models/{repo}"):]
                if rest.startswith("/tree/"):
                    return self._api(rest[len("/tree/"):].split("/")[0], tree=True)
                return self._api(rest[len("/revision/"):] if rest.startswith("/revision/") else "main", tree=False)
            if path.startswith(f"/{repo}/resolve/"):
                revision, _, file = path[len(f"/{repo}/resolve/"):].partition("/")
                return self._file(revision, file, head)
            self._error(404, "RepoNotFound", "Repository not found")

        def _refused(self, revision: str) -> bool:
            if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._error(401, "RepoNotFound", "Repository not found")
            elif hub.gated and not self.headers.get("Authorization"):
                self._error(403, "GatedRepo", "Access to this model is restricted")
            elif revision not in ("main", COMMIT):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            else:
                return False
            return True

        def _api(self, revision: str, tree: bool) -> None:
            if self._refused(revision):
                return
            if tree:
                body = [{"type": "file", "path": p, "size": len(b), "oid": _oid(b)} for p, b in hub.files.items()]
            else:
                body = {"id": hub.repo_id, "sha": COMMIT, "siblings": [{"rfilename": p} for p in hub.files]}
            self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head=False)

        def _file(self, revision: str, file: str, head: bool) -> None:
            if self._refused(revision):
                return
            if file not in hub.files:
                return self._error(404, "EntryNotFound", f"{file} does not exist")
            data = hub.files[file]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{_oid(data)}"', "Accept-Ranges": "bytes"}
            start = 0
            ranged = self.headers.get("Range")
            if ranged and ranged.startswith("bytes="):
                first, _, last = ranged[len("bytes="):].partition("-")
                start, end = int(first), int(last) if last else len(data) - 1
                headers["Content-Range"] = f"bytes {start}-{min(end, len(data) - 1)}/{len(data)}"
                data = data[start : end + 1]
            if not head and file in hub.cut_once:
                hub.cut_once.discard(file)
                return self._cut(data, headers)
            self._send(206 if ranged else 200, data, headers, head=head)

        def _cut(self, data: bytes, headers: dict[str, str]) -> None:
            """Announce the whole file, send half, close: what a killed connection leaves."""
            self.send_response(200)
            for key, value in {**headers, "Content-Length": str(len(data))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True

        def _error(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self._send(status, body, {"X-Error-Code": code, "X-Error-Message": message,
                                      "Content-Type": "application/json"}, head=self.command == "HEAD")  # fmt: skip

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

    return Handler


def _oid(data: bytes) -> str:
    return hashlib.sha1(data).hexdigest()
