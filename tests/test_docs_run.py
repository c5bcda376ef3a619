"""The docs tier (``bash scripts/test.sh -m docs``): every command and Python snippet of ``README.md``, ``docs/*.md``
and ``docs/layouts/*.md`` runs, and what the doc shows comes out.

One test per doc. Its blocks run in order in one fresh temporary folder (so a block may use what an earlier block
of the same doc wrote, and nothing else), with ``.venv/bin`` first on ``PATH`` (docs write bare ``hsdp``, as after
``source .venv/bin/activate``) and the built-in model cache every entry point shares (``$HSDP_CACHE``, default
``~/.cache/hsdp``), so built-ins are written once. How a fenced block is read:

- ``bash`` / ``sh`` / ``console`` blocks run; so does any block with ``$ `` lines. Without ``$ `` lines the block is one
  script (``bash -e -o pipefail``). With them, each ``$ `` line is a command run on its own, and the lines after it
  (up to the next ``$ ``) are its printed output.
- ``python`` blocks run as a script (``python snippet.py``), or under ``torchrun`` with a ``torchrun N`` directive.
- Other blocks (``text``, plain, ``json``) are not run, unless marked ``output``: then they are the printed output
  of the block run before them.

Directives, in an HTML comment on the line before the block (several separated by ``;``):
``<!-- docs-test: skip (needs a GPU) -->`` (not run; the reason is required and reported), ``output``,
``exit N`` (every command of the block exits with N; default 0), ``background`` (each line starts a server that
stays up until the doc ends or another server takes its port; the block is done when ``/health`` answers),
``torchrun N``, ``timeout S`` (seconds for the block; default :data:`BLOCK_TIMEOUT_S`), ``in the repository``
(runs in the checkout's root, for ``bash scripts/demo.sh``).

Printed output is checked line by line, in order, against everything the command printed (stdout and stderr, with
whitespace runs taken as one space, so a line the doc wraps still matches): ``[varies]`` in a doc line stands for
any text (a time, a memory figure, a path), a line ``...`` for any number of lines; everything else must appear as
written. Files a command names as ``--output``, ``--export``, ``--export-merged``, ``-o`` or ``> FILE`` must exist
afterwards (for several outputs, the numbered ``NAME_0.EXT``), unless the block expects a failing exit. Ports given as ``--port N`` are replaced by free
ports throughout the doc, so the tier does not collide with other servers on the machine.

How a command starts: each ``hsdp``, ``python`` and ``torchrun`` a block runs is a child forked from the tier's fork
server (:mod:`tests.docs_forkserver`, one per pytest worker), which has torch, diffusers, transformers and hsdp's
commands imported: the command's own process, with its stdio, working directory, environment, exit code and
signals, minus the ~4.5 s of imports a fresh interpreter pays (a torchrun's ranks come back through the server too).
A command the server cannot run as a fresh process would run (a variable read at import such as
``HF_HUB_OFFLINE``, ``.venv/bin/hsdp`` by its path) starts a fresh interpreter, as every command does where torch
is built for an accelerator (a forked command could not use it: no server then) or with ``HSDP_DOCS_FORK=0``. After each
block the test prints its seconds and the path each command took, and checks that against the inventory's
(:func:`block_paths`).

``python tests/test_docs_run.py`` prints the inventory: blocks run and skipped (with reasons), how each run block's
commands start, and the documented commands executed vs present.
"""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.docs_forkserver import RUNTIME_ENV, write_shims  # noqa: E402
from tests.test_docs_commands import DOC_COMMANDS, DOC_FILES, ROOT  # noqa: E402

pytestmark = [pytest.mark.docs, pytest.mark.slow]

# Room for a loaded machine: the slowest blocks take ~60 s on an idle 2-core machine and ran past 240 s with
# other work on it; a block that hangs still fails.
BLOCK_TIMEOUT_S = 600
SERVER_READY_S = 180
VARIES = "[varies]"
SHELL_INFOS = {"bash", "sh", "shell", "console"}
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
OUTPUT_FLAGS = {"--output", "--export", "--export-merged", "-o", ">"}


@dataclass
class Block:
    doc: str
    line: int  # line of the opening fence
    info: str
    lines: list[str]
    directives: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def session(self) -> bool:
        return any(line.startswith("$ ") for line in self.lines)

    @property
    def kind(self) -> str:
        """``skip``, ``output``, ``python``, ``shell`` or ``other`` (not run)."""
        if "skip" in self.directives:
            return "skip"
        if "output" in self.directives:
            return "output"
        if self.info == "python":
            return "python"
        if self.info in SHELL_INFOS or self.session:
            return "shell"
        return "other"

    def commands(self) -> list[tuple[str, list[str]]]:
        """``(command, expected output lines)`` in order: the ``$ `` lines of a session, else the whole script."""
        if not self.session:
            return [("\n".join(self.lines), [])]
        joined: list[str] = []
        for line in self.lines:  # a command continued with "\\" is one line
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
            else:
                joined.append(line)
        found: list[tuple[str, list[str]]] = []
        for line in joined:
            if line.startswith("$ "):
                found.append((line[2:], []))
            elif found:
                found[-1][1].append(line)
        return found


def parse_directives(comment: str) -> dict[str, str]:
    """``"skip (needs a GPU); timeout 60"`` -> ``{"skip": "needs a GPU", "timeout": "60"}``."""
    directives = {}
    skip = re.search(r"\bskip\b\s*(?:\((.*)\))?", comment)  # a reason may hold ";"
    if skip:
        if not (skip.group(1) or "").strip():
            raise ValueError(f"docs-test skip without a reason: {comment!r}")
        directives["skip"] = skip.group(1).strip()
        comment = comment[: skip.start()] + comment[skip.end() :]
    for part in filter(None, (p.strip() for p in comment.split(";"))):
        if part == "in the repository":
            directives["repo"] = ""
        else:
            key, _, value = part.partition(" ")
            if key not in {"output", "exit", "background", "torchrun", "timeout"}:
                raise ValueError(f"unknown docs-test directive {part!r}")
            directives[key] = value.strip()
    return directives


def blocks_in(text: str, doc: str) -> list[Block]:
    """Every fenced block of ``text`` with the directives of the comment just before it."""
    blocks: list[Block] = []
    current: Block | None = None
    last_text = ""  # the last non-blank line outside a block
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            if current is None:
                match = DIRECTIVE.search(last_text)
                directives = parse_directives(match.group(1)) if match else {}
                current = Block(doc, number, stripped[3:].strip().lower(), [], directives)
            else:
                blocks.append(current)
                current = None
                last_text = ""
            continue
        if current is not None:
            current.lines.append(line)
        elif stripped:
            last_text = stripped
    return blocks


DOCS = {str(path.relative_to(ROOT)): path for path in DOC_FILES}
for extra in sorted((ROOT / "docs").glob("*/*/*.md")):
    DOCS.setdefault(str(extra.relative_to(ROOT)), extra)


def doc_blocks(doc: str) -> list[Block]:
    return blocks_in(DOCS[doc].read_text(), doc)


# --- matching printed output -------------------------------------------------------------------------------------


def _flat(text: str) -> str:
    return " ".join(text.replace("\r", "\n").split())


def _pattern(line: str) -> re.Pattern:
    pieces = [re.escape(piece) for piece in _flat(line).split(VARIES)]
    return re.compile(r".*?".join(pieces), re.DOTALL)


def missing_output(expected: list[str], printed: str) -> str | None:
    """The first expected line not printed (in order), or None; ``[varies]`` and ``...`` as the module says."""
    flat = _flat(printed)
    position = 0
    for line in expected:
        if not line.strip() or line.strip() == "...":
            continue
        match = _pattern(line).search(flat, position)
        if match is None:
            return line
        position = match.end()
    return None


def expected_files(command: str) -> list[str]:
    """Files the command says it writes (``--output X``, ``--export X``, ``-o X``, ``> X``)."""
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError:
        return []
    tokens = [t for raw in tokens for t in re.split(r"(?<=>)(?=\S)", raw)]
    files = []
    for flag, value in zip(tokens, tokens[1:], strict=False):
        if flag in OUTPUT_FLAGS and not value.startswith(("-", "/dev/")):
            files.append(value)
    return files


def _written(folder: Path, name: str) -> bool:
    path = folder / name
    numbered = path.with_name(f"{path.stem}_0{path.suffix}")
    return path.exists() or numbered.exists()


# --- running ------------------------------------------------------------------------------------------------------


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to a bind to port 0 (Linux's ``ip_local_port_range``; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports below the kernel's ephemeral range. A port the kernel picked (bind to
    port 0) was free only at that moment: a server the doc starts minutes later found it taken by another process's
    ephemeral port (gloo, a client, another server on the machine), "Address already in use". Below that range
    only an explicit bind can take it."""
    low = _ephemeral_low()
    chosen: list[int] = []
    candidates = range(max(1024, low - 12000), low)
    for port in random.sample(candidates, k=min(400, len(candidates))):
        if len(chosen) == count:
            break
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
    assert len(chosen) == count, f"no {count} free ports below {low}"
    return chosen


_COLLECTED_ENV = dict(os.environ)
"""The worker's environment when the tier was collected, before any test ran: what the docs' commands get. The live
one carries what other tests of the worker left in it, which a fork server started earlier lacks, so a command
would run plain for it."""


def _environment(shims: Path | None = None) -> dict[str, str]:
    env = dict(_COLLECTED_ENV)
    env.pop("PYTEST_CURRENT_TEST", None)  # pytest's, changing with each test: the fork server's would differ
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if shims is not None:
        env["PATH"] = f"{shims}{os.pathsep}{env['PATH']}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


FORK_ENV = "HSDP_DOCS_FORK"
"""``HSDP_DOCS_FORK=0``: every command of the tier starts a fresh interpreter (no fork server)."""


class ForkServer:
    """The tier's fork server (:mod:`tests.docs_forkserver`): started once per pytest worker, with the tier's
    environment; the ``hsdp`` and ``python`` shims in :attr:`shims`, first on ``PATH``, run each command in a child
    forked from it. :meth:`paths` reads which path each command took since the last call."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="hsdp-docs-fork-"))  # short: a unix socket path has ~100 bytes
        self.shims = self.folder / "bin"
        self.record = self.folder / "record.txt"
        self.record.touch()
        self._read = 0
        socket_path = self.folder / "server.sock"
        write_shims(self.shims, socket_path)
        self.log = open(self.folder / "server.log", "w")  # noqa: SIM115 (closed in close())
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("docs_forkserver.py")), str(socket_path), str(self.record)],
            env=_environment(self.shims),
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 60
        while not socket_path.exists() and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # the socket is bound before the imports: a command waits for them in its connect

    def paths(self) -> list[str]:
        """The records written since the last call: ``fork hsdp ...`` or ``plain (REASON) python ...``."""
        text = self.record.read_text()
        new, self._read = text[self._read :], len(text)
        return new.splitlines()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class DocRun:
    """Runs one doc's blocks in order in ``folder``; servers started by ``background`` blocks live until close()."""

    def __init__(self, doc: str, folder: Path, fork_server: ForkServer | None = None):
        self.doc = doc
        self.folder = folder
        self.fork_server = fork_server
        self.env = _environment(fork_server.shims if fork_server else None)
        self.servers: dict[int, subprocess.Popen] = {}
        self.last_output = ""
        self.ran: list[str] = []
        self.skipped: list[tuple[str, str]] = []
        text = DOCS[doc].read_text()
        ports = {int(p) for p in re.findall(r"--port[ =](\d+)", text)}
        self.ports = dict(zip(sorted(ports), _free_ports(len(ports)), strict=True))

    def _localize(self, text: str) -> str:
        for documented, free in self.ports.items():
            text = re.sub(rf"(?<!\d){documented}(?!\d)", str(free), text)
        return text

    def run(self, block: Block) -> None:
        kind = block.kind
        if kind == "skip":
            self.skipped.append((block.where, block.directives["skip"]))
        elif kind == "output":
            lines = [self._localize(line) for line in block.lines]
            problem = missing_output(lines, self.last_output)
            assert problem is None, self._failure(
                block, f"the doc shows {problem!r}, not printed", self.last_output
            )
        elif kind in ("shell", "python"):
            if "background" in block.directives:
                self._start_servers(block)
            else:
                self._run_commands(block)
            self.ran.append(block.where)

    def _cwd(self, block: Block) -> Path:
        return ROOT if "repo" in block.directives else self.folder

    def _run_commands(self, block: Block) -> None:
        timeout = float(block.directives.get("timeout") or BLOCK_TIMEOUT_S)
        want_exit = int(block.directives.get("exit") or 0)
        self.last_output = ""
        if block.kind == "python":
            commands = [(self._python_command(block), [])]
        else:
            commands = [
                (self._localize(c), [self._localize(line) for line in out]) for c, out in block.commands()
            ]
        for command, expected in commands:
            started = time.monotonic()
            try:
                done = subprocess.run(
                    ["bash", "-e", "-o", "pipefail", "-c", command],
                    cwd=self._cwd(block),
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired as exc:
                printed = (exc.stdout or b"").decode(errors="replace") + (exc.stderr or b"").decode(
                    errors="replace"
                )
                raise AssertionError(
                    self._failure(block, f"did not finish in {timeout:.0f}s", printed)
                ) from None
            printed = done.stdout + done.stderr
            self.last_output += printed
            elapsed = time.monotonic() - started
            assert done.returncode == want_exit, self._failure(
                block,
                f"exit code {done.returncode}, the doc expects {want_exit} ({elapsed:.0f}s): {command}",
                printed,
            )
            problem = missing_output(expected, printed)
            assert problem is None, self._failure(block, f"the doc shows {problem!r}, not printed", printed)
            for name in expected_files(command) if block.kind == "shell" and not want_exit else ():
                assert _written(self._cwd(block), name), self._failure(
                    block, f"{name} was not written", printed
                )

    def _python_command(self, block: Block) -> str:
        script = self.folder / f"snippet_{block.line}.py"
        script.write_text(self._localize("\n".join(block.lines)) + "\n")
        if "torchrun" in block.directives:
            nproc = block.directives["torchrun"] or "2"
            return f"torchrun --standalone --nproc-per-node {nproc} {script.name}"
        return f"python {script.name}"

    def _start_servers(self, block: Block) -> None:
        for command, _ in block.commands():
            for raw in command.replace("\\\n", " ").splitlines():
                line = self._localize(raw.split(" #")[0].strip())
                if not line or line.startswith("#"):
                    continue
                port = int(re.search(r"--port[ =](\d+)", line).group(1))
                self._stop(port)
                log = open(self.folder / f"server-{port}.log", "w")  # noqa: SIM115 (closed with the process)
                self.servers[port] = subprocess.Popen(
                    ["bash", "-c", line],
                    cwd=self._cwd(block),
                    env=self.env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                self._wait_ready(block, port)

    def _wait_ready(self, block: Block, port: int) -> None:
        process = self.servers[port]
        deadline = time.monotonic() + SERVER_READY_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(self._failure(block, f"server on port {port} exited", self._log(port)))
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(
            self._failure(block, f"server on port {port} not ready in {SERVER_READY_S}s", self._log(port))
        )

    def _log(self, port: int) -> str:
        return (self.folder / f"server-{port}.log").read_text(errors="replace")

    def _stop(self, port: int) -> None:
        process = self.servers.pop(port, None)
        if process is None or process.poll() is not None:
            return
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def close(self) -> None:
        for port in list(self.servers):
            self._stop(port)

    def _failure(self, block: Block, what: str, printed: str) -> str:
        tail = "\n".join(printed.replace("\r", "\n").splitlines()[-40:])
        return f"{block.where}: {what}\n--- printed (last 40 lines) ---\n{tail}"


def _check_paths(block: Block, records: list[str]) -> None:
    """Each command that reached a shim took the path :func:`block_paths` says (the inventory's), so a change that
    sends the tier's commands back to fresh interpreters (a thread started at import, an environment variable)
    fails here by name instead of only making the tier slower. A server that cannot fork at all on this machine (a
    CUDA build of torch: ``plain (fork: ...)``) runs every command plainly, as it says."""
    expected = [p.split()[0] for p in block_paths(block) if p == "fork" or p.startswith("plain (environment")]
    got = [r.split()[0] for r in records if not r.startswith("plain (fork: ")]
    if any(r.startswith("plain (fork: ") for r in records):
        expected = expected[: len(got)]
    assert sorted(got) == sorted(expected), f"{block.where}: commands took {records}, the inventory says {expected}"


def _no_fork_server() -> str | None:
    """Why the tier runs without its fork server: asked to, or a torch built for an accelerator, where
    :func:`hsdp.launch.fork_problem` refuses every fork (the server would import for nothing)."""
    from hsdp.launch.group import _accelerator_built

    if os.environ.get(FORK_ENV, "1") == "0":
        return f"{FORK_ENV}=0"
    accelerator = _accelerator_built()
    return f"torch is built for {accelerator}: a forked command could not use it" if accelerator else None


@pytest.fixture(scope="session")  # the docs spread over the workers between other files' tests: one per worker
def fork_server():
    if _no_fork_server():
        yield None
        return
    server = ForkServer()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(2400)  # a whole doc, its blocks in turn, on a loaded machine
@pytest.mark.parametrize("doc", sorted(DOCS))
def test_doc_runs(doc: str, tmp_path: Path, fork_server: ForkServer | None):
    runner = DocRun(doc, tmp_path, fork_server)
    if fork_server:
        fork_server.paths()  # what an earlier doc's servers recorded since is theirs
    try:
        for block in doc_blocks(doc):
            started = time.monotonic()
            runner.run(block)
            if block.kind in ("shell", "python"):
                paths = fork_server.paths() if fork_server else [f"plain ({_no_fork_server()})"]
                print(f"{block.where}: {time.monotonic() - started:.1f}s; " + "; ".join(paths))
                if fork_server:
                    _check_paths(block, paths)
    finally:
        runner.close()


PROGRAM = re.compile(r"(?:^|[;&|(`]|\$\(|\bdo|\bthen)\s*((?:[A-Za-z_]\w*=\S*\s+)*)((?:[\w.~-]*/)*)(hsdp|python|torchrun)(?=\s|$)(\s+\S+)?")


def block_paths(block: Block) -> list[str]:
    """How each ``hsdp`` / ``python`` / ``torchrun`` command of a run block starts, as the fork server decides
    (:mod:`tests.docs_forkserver`): ``fork`` (a child of the server, its imports done) or ``plain (why)`` (a fresh
    interpreter); what the tier prints after each block is what happened."""
    if block.kind == "python":  # under torchrun: the agent, then each rank (`python -u snippet.py`)
        return ["fork"] * (1 + int(block.directives["torchrun"] or 2) if "torchrun" in block.directives else 1)
    text = "\n".join(command for command, _ in block.commands()).replace("\\\n", " ")
    if "source .venv/bin/activate" in text:
        return ["plain (.venv/bin first on PATH)"]
    paths = []
    for line in text.splitlines():
        for match in PROGRAM.finditer(line.strip()):
            assigned, folder, program, first = match.groups()
            names = set(re.findall(r"([A-Za-z_]\w*)=", assigned)) - RUNTIME_ENV
            if folder:
                paths.append(f"plain ({folder}{program}: not the shim)")
            elif names:
                paths.append(f"plain (environment: {', '.join(sorted(names))} read at import)")
            elif program == "python" and first and first.strip().startswith("-") and first.strip() not in ("-c", "-"):
                paths.append(f"plain (python option {first.strip()})")
            else:
                ranks = re.search(r"--nproc[-_]per[-_]node[ =](\d+)", line) if program == "torchrun" else None
                paths += ["fork"] * (1 + (int(ranks.group(1)) if ranks else 0))  # torchrun: its ranks too
    return paths or ["no hsdp or python command"]


def inventory() -> str:
    """Blocks run and skipped per doc, and the documented commands (tests/test_docs_commands.py) executed."""
    rows, executed = [], 0
    run_lines: set[tuple[str, int]] = set()
    for doc in sorted(DOCS):
        blocks = doc_blocks(doc)
        ran = [b for b in blocks if b.kind in ("shell", "python")]
        for block in ran:
            run_lines |= {(doc, block.line + i) for i in range(len(block.lines) + 2)}
        rows.append(f"{doc}: {len(ran)} blocks run, {sum(b.kind == 'skip' for b in blocks)} skipped")
        for block in ran:
            paths = block_paths(block)
            summary = ", ".join(f"{paths.count(p)} {p}" for p in dict.fromkeys(paths))
            rows.append(f"    ran {block.where} ({block.kind}): {summary}")
        rows += [f"    skipped {b.where}: {b.directives['skip']}" for b in blocks if b.kind == "skip"]
    for command in DOC_COMMANDS:
        doc, line = command.where.rsplit(":", 1)
        ran = (doc, int(line)) in run_lines
        executed += ran
        if not ran:
            rows.append(f"not executed (in a skipped block): {command.where} {command.program} {shlex.join(command.argv[:1])}")
    rows.append(f"documented commands executed: {executed} of {len(DOC_COMMANDS)}")
    return "\n".join(rows)


if __name__ == "__main__":
    print(inventory())


def test_fork_server_commands_behave_as_fresh_processes(fork_server: ForkServer | None, tmp_path: Path):
    """What the docs tier relies on from its fork server (tests/docs_forkserver.py): a forked ``python`` / ``hsdp``
    has the caller's stdin, stdout, stderr, working directory and environment, its exit code and its signals reach
    the caller (``kill -TERM`` of the shim is the command's), ``atexit`` runs, a killed shim takes its command with
    it, a variable read at import sends the command to a fresh interpreter, and an ``hsdp`` command's ranks still
    start by fork."""
    if fork_server is None:
        pytest.skip(f"no fork server: {_no_fork_server()}")
    env = {**_environment(fork_server.shims), "HSDP_API_KEY": "k1"}
    fork_server.paths()
    subprocess.run(["python", "-c", "pass"], env=env, check=True, timeout=600)
    (first,) = fork_server.paths()
    if first.startswith("plain (fork: "):
        pytest.skip(f"the fork server cannot fork on this machine: {first}")
    script = r"""
echo 'import sys; print("script", sys.argv[0], __file__)' > s.py && python s.py
printf 'from stdin' | python -c 'import sys, os; print(sys.stdin.read(), os.getcwd(), os.environ["HSDP_API_KEY"]); print("to stderr", file=sys.stderr); sys.exit(3)' || echo "exit $?"
HSDP_API_KEY=k2 python - <<'PY'
import atexit, os
atexit.register(print, "atexit ran", os.environ["HSDP_API_KEY"])
PY
python -c 'import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(7)); print("up", flush=True); time.sleep(600)' > term.txt & pid=$!
until [ -s term.txt ]; do sleep 0.1; done
kill -TERM "$pid"; wait "$pid" || echo "term exit $?"
python -c 'import os, time; print(os.getpid(), flush=True); time.sleep(600)' > killed.txt & pid=$!
until [ -s killed.txt ]; do sleep 0.1; done
kill -KILL "$pid"; wait "$pid" || true
child=$(cat killed.txt)
for _ in $(seq 600); do kill -0 "$child" 2>/dev/null || break; sleep 0.1; done
kill -0 "$child" 2>/dev/null && echo "child $child outlived its shim" || echo "child gone"
HF_HUB_OFFLINE=1 python -c 'print("fresh")'
OMP_NUM_THREADS=1 python -c 'import torch; print("torch threads", torch.get_num_threads())'
python -c 'import signal; print("background SIGINT ignored:", signal.getsignal(signal.SIGINT) == signal.SIG_IGN)' & wait $!
hsdp generate --model tiny-llama --use-hsdp --hsdp-shard-size 2 --prompt Hi --max-new-tokens 1 --log-level debug
"""
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed
    assert f"script s.py {tmp_path}/s.py\nfrom stdin {tmp_path} k1\nexit 3\n" in done.stdout and "to stderr" in done.stderr, printed
    assert "atexit ran k2" in done.stdout and "term exit 7" in done.stdout and "child gone" in done.stdout, printed
    assert "fresh" in done.stdout and "process start (2 ranks by fork)" in done.stderr, printed
    assert "background SIGINT ignored: True" in done.stdout and "torch threads 1" in done.stdout, printed  # as bash starts `cmd &`
    records = fork_server.paths()
    assert [r.split()[0] for r in records] == ["fork"] * 5 + ["plain", "fork", "fork", "fork"], records
    assert "plain (environment: HF_HUB_OFFLINE read at import)" in records[5], records
