"""Start-up cost of the ``hsdp`` commands against the floor: what a user waits for beyond the model's own work.

Each row is one fresh command, timed from its start (imports included) by this script:

* ``floor: import torch`` -- ``python -c "import torch"``;
* ``floor: diffusers, one process`` -- plain diffusers running the same tiny-wan request in one process
  (``DiffusionPipeline.from_pretrained``, the call, the mp4 written as hsdp writes it): the issue's reference;
* ``floor: transformers, one process`` -- greedy ``generate`` of tiny-llama with plain transformers, and one
  training step (AdamW) of it: the floors of ``hsdp generate`` / ``hsdp train`` on tiny-llama;
* ``hsdp generate`` on tiny-wan (64 x 64, 9 frames, 2 steps) and tiny-llama (16 tokens), on one rank and on two
  (``--use-hsdp --hsdp-shard-size 2``);
* ``hsdp serve tiny-llama`` at HSDP 2 until ``/health`` answers 200, then an engine restart after a worker is
  SIGKILLed ``--settle`` seconds later (from the kill until ``/health`` is 200 again);
* ``hsdp train`` on tiny-llama at HSDP 2 until its first step's log line.

``first line`` is when the command first wrote anything (the issue's target: within 1 s); ``x floor`` is the wall
time over the matching one-process floor. The machine's load is in the JSON (a shared 2-core host makes every
number an upper bound: compare rows of one run, not runs).

    .venv/bin/python benchmarks/startup.py                   # every row once
    .venv/bin/python benchmarks/startup.py --repeats 3       # the median of 3 runs per row
    .venv/bin/python benchmarks/startup.py --only serve      # rows whose name contains "serve" (and their floors)
    HSDP_START_METHOD=forkserver .venv/bin/python benchmarks/startup.py   # the launcher before issue 34
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _report import write_report  # noqa: E402

WAN = ["--height", "64", "--width", "64", "--num-frames", "9", "--num-inference-steps", "2"]
HSDP2 = ["--use-hsdp", "--hsdp-shard-size", "2"]

DIFFUSERS_FLOOR = """
import sys, torch
from pathlib import Path
from diffusers import DiffusionPipeline
from hsdp.engine.outputs import save_frames
from hsdp.models.builtin import resolve_model
pipe = DiffusionPipeline.from_pretrained(str(resolve_model("tiny-wan")))
out = pipe("a cat", height=64, width=64, num_frames=9, num_inference_steps=2, output_type="np",
           generator=torch.Generator().manual_seed(0))
save_frames(out.frames[0], Path(sys.argv[1]), fps=8)
"""

TRANSFORMERS_FLOOR = """
import sys, torch
from transformers import AutoModelForCausalLM
from hsdp.models.builtin import resolve_model
model = AutoModelForCausalLM.from_pretrained(str(resolve_model("tiny-llama")))
ids = torch.tensor([[1, 2, 3, 4]])
if sys.argv[1] == "generate":
    print(model.generate(ids, max_new_tokens=16, do_sample=False)[0].tolist())
else:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randint(0, model.config.vocab_size, (4, 64))
    model(batch, labels=batch).loss.backward()
    optimizer.step()
    print("step 1")
"""


def _hsdp(*args: str) -> list[str]:
    return [sys.executable, "-m", "hsdp.cli", *args]


def _timed(cmd: list[str], cwd: Path, until: str | None = None, timeout_s: float = 600) -> dict:
    """Run ``cmd``; the wall time to its end (or to the first output line containing ``until``, when the process
    is then killed) and to its first output line."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    first = None
    seen = b""
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = started + timeout_s
    while time.perf_counter() < deadline:
        if not selector.select(timeout=0.05):
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            break
        first = first or time.perf_counter() - started
        seen += chunk
        if until and until.encode() in seen:
            break
    wall = time.perf_counter() - started
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    code = proc.wait()
    if until is None and code != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {code}:\n{seen.decode(errors='replace')[-3000:]}")
    if until is not None and until.encode() not in seen:
        raise RuntimeError(f"{' '.join(cmd)} never printed {until!r}:\n{seen.decode(errors='replace')[-3000:]}")
    return {"wall_s": wall, "first_line_s": first}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _descendants(pid: int) -> list[int]:
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            except OSError:
                continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _ranks(server_pid: int) -> list[int]:
    """The server's worker ranks: its descendants other than multiprocessing's helpers (the resource tracker, and
    the forkserver, a child of the server itself; ranks forked by it share its command line)."""
    ranks = []
    for pid in _descendants(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
        forkserver = b"multiprocessing.forkserver" in command and pid in _children(server_pid)
        if b"resource_tracker" not in command and not forkserver:
            ranks.append(pid)
    return ranks


def _children(pid: int) -> list[int]:
    return [p for p in _descendants(pid) if _parent(p) == pid]


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _serve(cwd: Path, settle_s: float, timeout_s: float = 600) -> dict:
    """``hsdp serve tiny-llama`` at HSDP 2: seconds to ``/health`` 200, then, ``settle_s`` later, from a rank's
    SIGKILL to 200 again."""
    port = _free_port()
    started = time.perf_counter()
    cmd = _hsdp("serve", "tiny-llama", *HSDP2, "--port", str(port))
    log = open(cwd / "serve.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        first = None
        while _health(port) != 200:
            if proc.poll() is not None or time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"hsdp serve never got ready:\n{(cwd / 'serve.log').read_text()[-3000:]}")
            if first is None and (cwd / "serve.log").stat().st_size:
                first = time.perf_counter() - started
            time.sleep(0.05)
        ready = time.perf_counter() - started
        time.sleep(settle_s)  # a worker dies in service, not while the server starts its forkserver
        ranks = _ranks(proc.pid)
        if len(ranks) != 2:
            raise RuntimeError(f"expected the server's 2 ranks, found processes {ranks}")
        killed = time.perf_counter()
        os.kill(ranks[-1], signal.SIGKILL)
        while _health(port) == 200:
            if time.perf_counter() - killed > 30:
                raise RuntimeError("the server did not notice its rank's death within 30 s")
            time.sleep(0.02)
        while _health(port) != 200:
            if proc.poll() is not None or time.perf_counter() - killed > timeout_s:
                raise RuntimeError(f"the engine never restarted:\n{(cwd / 'serve.log').read_text()[-3000:]}")
            time.sleep(0.05)
        restart = time.perf_counter() - killed
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    return {"ready_s": ready, "restart_s": restart, "first_line_s": first}


def _cases(work: Path, settle_s: float) -> list[tuple[str, str | None, object]]:
    """(name, the floor it is compared with, how to time it)."""
    sample = work / "sample.txt"
    sample.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    wan = ["generate", "--model", "tiny-wan", "--prompt", "a cat", *WAN, "--output"]
    llama = ["generate", "--model", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "16"]
    train = ["train", "--model", "tiny-llama", "--data", str(sample), *HSDP2, "--steps", "3", "--batch-size", "4",
             "--seq-len", "64", "--output-dir", str(work / "run")]  # fmt: skip
    floor_tf = [sys.executable, "-c", TRANSFORMERS_FLOOR]
    return [
        ("floor: import torch", None, lambda: _timed([sys.executable, "-c", "import torch"], work)),
        ("floor: diffusers, one process (tiny-wan)", None,
         lambda: _timed([sys.executable, "-c", DIFFUSERS_FLOOR, "ref.mp4"], work)),
        ("floor: transformers, one process (tiny-llama generate)", None,
         lambda: _timed([*floor_tf, "generate"], work)),
        ("floor: transformers, one process (tiny-llama first step)", None,
         lambda: _timed([*floor_tf, "train"], work)),
        ("hsdp generate tiny-wan, 1 rank", "floor: diffusers, one process (tiny-wan)",
         lambda: _timed(_hsdp(*wan, "one.mp4"), work)),
        ("hsdp generate tiny-wan, HSDP 2", "floor: diffusers, one process (tiny-wan)",
         lambda: _timed(_hsdp(*wan, "two.mp4", *HSDP2), work)),
        ("hsdp generate tiny-llama, 1 rank", "floor: transformers, one process (tiny-llama generate)",
         lambda: _timed(_hsdp(*llama), work)),
        ("hsdp generate tiny-llama, HSDP 2", "floor: transformers, one process (tiny-llama generate)",
         lambda: _timed(_hsdp(*llama, *HSDP2), work)),
        ("hsdp serve tiny-llama, HSDP 2", "floor: transformers, one process (tiny-llama generate)",
         lambda: _serve(work, settle_s)),
        ("hsdp train tiny-llama, HSDP 2, to its first step", "floor: transformers, one process (tiny-llama first step)",
         lambda: _timed(_hsdp(*train), work, until="step 1/")),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per row (the median is reported)")
    parser.add_argument("--only", default=None, help="rows whose name contains this (and their floors)")
    parser.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="seconds the server serves before a worker is killed (it starts its forkserver once ready)",
    )
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/startup.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cases = _cases(work, args.settle)
        chosen = {name for name, floor, _ in cases if floor is not None and (not args.only or args.only in name)}
        chosen |= {floor for name, floor, _ in cases if name in chosen} | {"floor: import torch"}
        for name, floor, run in cases:
            if name not in chosen:
                continue
            runs = [run() for _ in range(args.repeats)]
            row: dict = {"name": name, "floor": floor, "runs": runs}
            for key in runs[0]:
                values = [r[key] for r in runs if r[key] is not None]
                row[key] = statistics.median(values) if values else None
            base = next((r for r in rows if r["name"] == floor), None)
            main_s = row.get("wall_s") or row.get("ready_s")
            row["x_floor"] = main_s / base["wall_s"] if base and main_s else None
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "runs"}), flush=True)
    print(f"\n{'command':58s} {'wall/ready':>10s} {'first line':>10s} {'restart':>8s} {'x floor':>8s}")
    for row in rows:
        cells = [row.get("wall_s") or row.get("ready_s"), row.get("first_line_s"), row.get("restart_s")]
        text = [f"{v:9.1f}s" if v is not None else f"{'':10s}" for v in cells]
        x = f"{row['x_floor']:7.2f}x" if row["x_floor"] else ""
        print(f"{row['name']:58s} {text[0]:>10s} {text[1]:>10s} {text[2][1:]:>8s} {x:>8s}")
    method = os.environ.get("HSDP_START_METHOD") or "default"
    write_report("startup.py", args, started, rows, args.output, start_method=method)


if __name__ == "__main__":
    main()
