"""Schema fuzz of ``hsdp serve``: schemathesis generates requests from ``/openapi.json`` (valid and invalid) for
every operation and checks that the server never answers 5xx and that answers match the spec.

Starts local servers on free 127.0.0.1 ports (tiny-wan, then tiny-llama, both HSDP 2 with an API key and tight
limits so that valid generated requests stay cheap), runs ``schemathesis run`` against each with a bounded
number of examples per operation, and records how many test cases were tried and what failed. schemathesis
comes with the ``dev`` extra; ``tests/test_serve_fuzz.py`` runs :func:`fuzz` in the suite with 5 examples.

    .venv/bin/python benchmarks/serve_fuzz.py               # ~25 examples per operation, both models
    .venv/bin/python benchmarks/serve_fuzz.py --max-examples 100 --models tiny-llama
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from hsdp.serve.local import LocalServer

KEY = "fuzz-key"
LIMITS = [
    "--max-side",
    "64",
    "--max-frames",
    "9",
    "--max-steps",
    "2",
    "--max-new-tokens",
    "16",
    "--max-images",
    "2",
]
CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
COVERAGE_ON_THE_OTHER_SERVER = {
    "tiny-llama": ("POST /v1/images/generations", "POST /v1/audio/speech"),
    "tiny-wan": ("POST /v1/completions",),
}
"""Operations whose coverage phase (schemathesis' boundary and negative values of every field, about 250-350
requests each whatever ``--max-examples`` says, 80 % of a run) runs against the other server only. Both servers
publish the same schema, so the phase sends both the same requests; these routes run on neither model or only on
the other: they pass FastAPI's validation, the same code on both servers, then this server refuses them
(``wrong_model_kind``: an image or speech request to a causal LM, a text completion to a diffusion pipeline;
speech is refused by both, its coverage stays on the tiny-wan server, refused by output kind). Every operation
still gets the examples, fuzzing (valid and invalid) and stateful phases on both servers."""


def _count_cases(ndjson: Path) -> tuple[int, dict[str, int]]:
    """Test cases tried (one per HTTP call schemathesis made) and the failures by check name."""
    cases, failures = 0, {}
    for line in ndjson.read_text().splitlines():
        event = json.loads(line)
        finished = event.get("ScenarioFinished") or {}
        recorder = finished.get("recorder") or {}
        cases += len(recorder.get("interactions", {}))
        for check_list in (recorder.get("checks") or {}).values():
            for check in check_list:
                if check.get("status") == "FAILURE":
                    failures[check["name"]] = failures.get(check["name"], 0) + 1
    return cases, failures


def _config(model: str, path: Path) -> Path:
    """A schemathesis.toml turning the coverage phase off for :data:`COVERAGE_ON_THE_OTHER_SERVER`'s operations."""
    names = ", ".join(json.dumps(name) for name in COVERAGE_ON_THE_OTHER_SERVER.get(model, ()))
    path.write_text(f"[[operations]]\ninclude-name = [{names}]\nphases.coverage.enabled = false\n" if names else "")
    return path


def fuzz(model: str, workdir: Path, max_examples: int, seed: int) -> dict:
    args = ["--use-hsdp", "--hsdp-shard-size", "2", "--request-parallel", "--max-queue", "8", *LIMITS]
    args += ["--output-dir", str(workdir / model / "out")]  # info: access log lines count the 5xx
    (workdir / model).mkdir(parents=True, exist_ok=True)
    report = workdir / model / "events.ndjson"
    with LocalServer(model, args, log=workdir / model / "server.log", api_key=KEY) as server:
        cmd = [
            shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis"),
            "--config-file", str(_config(model, workdir / model / "schemathesis.toml")),
            "run", f"{server.url}/openapi.json",
            "--checks", CHECKS,
            "--max-examples", str(max_examples),
            "--seed", str(seed),
            "--header", f"Authorization: Bearer {KEY}",
            "--workers", "1",
            "--request-timeout", "120",
            "--suppress-health-check", "all",
            "--report", "ndjson", "--report-ndjson-path", str(report),
        ]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        server_errors = sum(
            1 for line in server.log.read_text().splitlines() if '" 5' in line and "HTTP/1.1" in line
        )
    cases, failures = _count_cases(report)
    tail = "\n".join(run.stdout.splitlines()[-25:])
    return {"model": model, "exit_code": run.returncode, "cases": cases, "failures": failures,
            "server_5xx_in_log": server_errors, "summary": tail}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny-wan", "tiny-llama"])
    parser.add_argument("--max-examples", type=int, default=25, help="per API operation and phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("bench_results/serve_fuzz.json"))
    return parser


def main() -> int:
    args = build_parser().parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="serve-fuzz-"))
    rows = [fuzz(model, workdir, args.max_examples, args.seed) for model in args.models]
    print(f"\n{'model':<12} | {'cases':>6} | {'5xx':>4} | failures by check")
    for row in rows:
        print(
            f"{row['model']:<12} | {row['cases']:>6} | {row['server_5xx_in_log']:>4} | {row['failures'] or 'none'}"
        )
    for row in rows:
        print(f"\n--- schemathesis, {row['model']} (exit {row['exit_code']}) ---\n{row['summary']}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"max_examples": args.max_examples, "seed": args.seed, "rows": rows}, indent=2)
    )
    print(f"wrote {args.output}")
    return (
        0
        if all(r["server_5xx_in_log"] == 0 and "not_a_server_error" not in r["failures"] for r in rows)
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
