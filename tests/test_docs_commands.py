"""Every command line written in ``README.md``, ``docs/*.md`` and ``docs/layouts/*.md`` parses with the real parser.

What counts as a command, and what a doc line may abbreviate:

- Only fenced code blocks are read. Lines ending in ``\\`` are joined with the next; ``#`` comments are dropped.
- In a block where any line starts with ``$ ``, only those lines are commands (the rest is printed output).
- A line is a command when, after leading ``NAME=value`` environment assignments, it starts with ``hsdp`` or
  ``.venv/bin/hsdp`` followed by a lower-case word (so a ``hsdp 8x1 ...`` row of ``hsdp plan``'s table is output,
  while ``hsdp generat`` is an unknown subcommand), contains ``-m hsdp.cli`` (``torchrun``, ``python -m``), or
  runs ``benchmarks/NAME.py`` with ``python`` / ``.venv/bin/python``.
- The command ends at the first shell operator (``|``, ``&&``, ``;``, ``>``, ...).
- ``...`` abbreviates. Right after an option that takes a value it is that value (``--prompt ...``). Anywhere
  else it stands for "the rest as in the command above": it is dropped, and the arguments the parser requires
  are not enforced for that line.
- Nothing else is special: a placeholder (``MODEL``, ``DIR``, ``notes.txt``) stands for itself, so it may only
  appear where the parser takes any string, and every flag and value written must be accepted
  (``--mixed-precision fp16`` fails where the parser allows only ``bf16``).

Benchmarks are parsed with their own argparse parser: ``build_parser()`` where the script has one; otherwise the
parser ``main()`` builds is captured at its ``parse_args`` call, before the benchmark does any work.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest

from hsdp.cli import COMMANDS, build_parser

# Parsers only: benchmark main()s stop at parse_args, so no benchmark or rank runs.
pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs").glob("*/*.md")),
]
SHELL_OPERATORS = {"|", "||", "&", "&&", ";", ">", ">>", "<", "(", ")"}
ELLIPSIS = "..."
# Lines worth tokenizing: the rest of a block (Python, JSON, printed output) need not be valid shell.
CANDIDATE = re.compile(r"\s*([A-Za-z_]\w*=\S*\s+)*(\S*/)?(hsdp|python[\d.]*|torchrun)(\s|$)")


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line, for the test id and the failure message
    program: str  # "hsdp" or a benchmark's path
    argv: tuple[str, ...]


def _fenced_blocks(text: str) -> Iterator[list[tuple[int, str]]]:
    """Each fenced block's lines with their line numbers, continuation lines joined."""
    block: list[tuple[int, str]] | None = None
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if block is not None:
                yield block
            block = None if block is not None else []
            pending = None
            continue
        if block is None:
            continue
        start, head = pending or (number, "")
        if line.endswith("\\"):
            pending = (start, head + line[:-1] + " ")
            continue
        pending = None
        block.append((start, head + line))


def _tokens(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    cut = next((i for i, t in enumerate(tokens) if t in SHELL_OPERATORS), len(tokens))
    return tokens[:cut]


def _as_command(tokens: list[str], where: str) -> DocCommand | None:
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        tokens = tokens[1:]
    if not tokens:
        return None
    if Path(tokens[0]).name == "hsdp":
        if len(tokens) > 1 and re.fullmatch(r"[a-z][a-z-]*", tokens[1]):
            return DocCommand(where, "hsdp", tuple(tokens[1:]))
        return None
    if "hsdp.cli" in tokens and tokens[tokens.index("hsdp.cli") - 1] == "-m":
        return DocCommand(where, "hsdp", tuple(tokens[tokens.index("hsdp.cli") + 1 :]))
    if Path(tokens[0]).name.startswith("python") and len(tokens) > 1 and tokens[1].startswith("benchmarks/"):
        return DocCommand(where, tokens[1], tuple(tokens[2:]))
    return None


def commands_in(text: str, name: str) -> list[DocCommand]:
    """The commands written in ``text``'s fenced blocks, by the rules of this module's docstring."""
    found = []
    for block in _fenced_blocks(text):
        session = any(line.startswith("$ ") for _, line in block)
        for number, line in block:
            if session and not line.startswith("$ "):
                continue
            line = line.removeprefix("$ ")
            if not CANDIDATE.match(line):
                continue
            try:
                tokens = _tokens(line)
            except ValueError as exc:  # an unclosed quote in a command is a doc bug too
                raise ValueError(f"{name}:{number}: {exc}: {line}") from exc
            command = _as_command(tokens, f"{name}:{number}")
            if command:
                found.append(command)
    return found


DOC_COMMANDS = [c for path in DOC_FILES for c in commands_in(path.read_text(), str(path.relative_to(ROOT)))]


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parser captured")
        self.parser = parser


def _load_benchmark(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_doc_benchmark_{path.stem}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    with mock.patch.object(sys, "path", [str(path.parent), *sys.path]):  # as `python benchmarks/x.py` runs it
        spec.loader.exec_module(module)
    return module


def benchmark_parser(path: Path) -> argparse.ArgumentParser:
    """The benchmark's own parser, without running the benchmark."""
    module = _load_benchmark(path)
    if hasattr(module, "build_parser"):
        return module.build_parser()

    def capture(parser: argparse.ArgumentParser, *args, **kwargs):
        raise _Captured(parser)

    # Scripts we do not own build their parser inside main(); stop main at its parse_args.
    try:
        with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
            module.main()
    except _Captured as captured:
        return captured.parser
    raise AssertionError(f"{path.name}: main() returned without parsing its arguments")


def _parser_for(command: DocCommand) -> argparse.ArgumentParser:
    if command.program == "hsdp":
        return build_parser()
    path = ROOT / command.program
    assert path.is_file(), f"{command.where}: no benchmark {command.program}"
    return benchmark_parser(path)


def _waive_required(parser: argparse.ArgumentParser) -> None:
    """For a line with ``...``: what the parser requires may be in the elided part; the subcommand is not."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _waive_required(sub)
        else:
            action.required = False


def _takes_value(parser: argparse.ArgumentParser, argv: tuple[str, ...], token: str) -> bool:
    """Whether ``token`` is an option of ``parser`` (or of the subcommand ``argv`` names) that takes a value."""
    parsers = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and argv and argv[0] in action.choices:
            parsers.append(action.choices[argv[0]])
    actions = [p._option_string_actions.get(token) for p in parsers]
    return any(a is not None and a.nargs != 0 for a in actions)


def parse_problem(parser: argparse.ArgumentParser, argv: tuple[str, ...]) -> str | None:
    """The parser's error for ``argv`` (``...`` handled as the module docstring says), or None."""
    elided = [
        i for i, a in enumerate(argv) if a == ELLIPSIS and not (i and _takes_value(parser, argv, argv[i - 1]))
    ]
    if elided:
        _waive_required(parser)
        argv = tuple(a for i, a in enumerate(argv) if i not in elided)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(list(argv))
    except SystemExit:
        return stderr.getvalue().strip().splitlines()[-1]
    return None


@pytest.mark.parametrize("command", DOC_COMMANDS, ids=lambda c: c.where)
def test_documented_command_parses(command: DocCommand):
    problem = parse_problem(_parser_for(command), command.argv)
    assert problem is None, f"{command.where}: {command.program} {shlex.join(command.argv)}\n{problem}"


def test_every_subcommand_is_documented():
    documented = {c.argv[0] for c in DOC_COMMANDS if c.program == "hsdp"}
    assert documented >= set(COMMANDS), f"no documented example of: {sorted(set(COMMANDS) - documented)}"


def _one(text: str) -> DocCommand:
    (command,) = commands_in(text, "snippet.md")
    return command


def test_refuses_a_value_the_parser_refuses():
    command = _one("```\nhsdp train --data x.txt --mixed-precision fp16\n```\n")
    assert "invalid choice: 'fp16'" in parse_problem(build_parser(), command.argv)


def test_refuses_an_unknown_subcommand_and_flag():
    assert "invalid choice: 'generat'" in parse_problem(
        build_parser(), _one("```\nhsdp generat --x\n```").argv
    )
    unknown = _one("```bash\nhsdp train --data x --request-parallel  # not a training flag\n```")
    assert "unrecognized arguments: --request-parallel" in parse_problem(build_parser(), unknown.argv)


def test_reads_commands_as_written():
    text = (
        "prose hsdp train --nope\n"
        "```\nHSDP_API_KEY=k .venv/bin/hsdp serve tiny-llama \\\n    --port 8092 > log.txt\n```\n"
        "```\n$ hsdp plan tiny-llama --devices 2 --device-memory 1KiB\nhsdp plan: nothing fits\n```\n"
        "```\nhsdp 8x1   26.67 GiB\n.venv/bin/torchrun --nproc-per-node 2 -m hsdp.cli demo\n```\n"
        "```\n.venv/bin/python benchmarks/comm.py --output x.json    # writes x.json\n```\n"
    )
    got = [(c.where, c.program, c.argv) for c in commands_in(text, "t.md")]
    assert got == [
        ("t.md:3", "hsdp", ("serve", "tiny-llama", "--port", "8092")),
        ("t.md:7", "hsdp", ("plan", "tiny-llama", "--devices", "2", "--device-memory", "1KiB")),
        ("t.md:12", "hsdp", ("demo",)),
        ("t.md:15", "benchmarks/comm.py", ("--output", "x.json")),
    ]


def test_ellipsis_waives_required_arguments_only():
    parser = build_parser()
    assert parse_problem(parser, ("train", "...", "--steps", "30", "--resume")) is None
    assert "invalid int value" in parse_problem(build_parser(), ("train", "...", "--steps", "many"))
    assert "required" in parse_problem(build_parser(), ("train", "--steps", "30"))
    # as an option's value, ``...`` is the value: the command must still be complete
    assert parse_problem(build_parser(), ("generate", "--model", "M", "--prompt", "...")) is None
    assert "required" in parse_problem(build_parser(), ("generate", "--prompt", "..."))


def test_benchmark_parser_without_build_parser_is_captured(tmp_path: Path):
    script = tmp_path / "bench.py"
    script.write_text(
        "import argparse\n"
        "def main():\n"
        "    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--output')\n"
        "    parser.parse_args()\n"
        "    raise RuntimeError('the benchmark ran')\n"
    )
    parser = benchmark_parser(script)
    assert parse_problem(parser, ("--output", "x.json")) is None
    assert "unrecognized arguments: --bogus" in parse_problem(benchmark_parser(script), ("--bogus", "x"))


# -- the docs tier's reading of the docs (tests/test_docs_run.py), checked without running anything -------------


def test_every_documented_command_runs_in_the_docs_tier():
    """Each command above lies in a block the docs tier runs, or in one skipped with its reason; so does every
    Python block (a snippet nobody runs drifts like a command)."""
    from tests.test_docs_run import DOCS, doc_blocks

    covered: set[tuple[str, int]] = set()
    unrun_python = []
    for doc in DOCS:
        for block in doc_blocks(doc):
            if block.kind in ("shell", "python", "skip"):
                covered |= {(doc, block.line + i) for i in range(1, len(block.lines) + 1)}
            elif block.info == "python":
                unrun_python.append(block.where)
    stray = [
        c.where
        for c in DOC_COMMANDS
        if (c.where.rsplit(":", 1)[0], int(c.where.rsplit(":", 1)[1])) not in covered
    ]
    assert not stray, (
        f"commands in blocks the docs tier neither runs nor skips (use ```bash or a directive): {stray}"
    )
    assert not unrun_python, f"Python blocks neither run nor skipped: {unrun_python}"


def test_skipped_blocks_name_tests_that_exist():
    """A block skipped because a test runs it names that test (``tests/NAME.py``); the file must exist, so a renamed
    or removed test does not leave the doc's command run nowhere."""
    from tests.test_docs_run import DOCS, doc_blocks

    missing = [
        f"{block.where}: {name}"
        for doc in DOCS
        for block in doc_blocks(doc)
        if block.kind == "skip"
        for name in re.findall(r"tests/[\w/]+\.py", block.directives["skip"])
        if not (ROOT / name).is_file()
    ]
    assert not missing, f"skipped blocks point to tests that do not exist: {missing}"


def test_docs_tier_reads_blocks_and_directives():
    from tests.test_docs_run import blocks_in

    text = (
        "<!-- docs-test: skip (needs a GPU) -->\n```bash\nhsdp generate --model big\n```\n"
        "```console\n$ hsdp plan tiny-llama \\\n    --devices 2\nrecommended: [varies]\n$ ls\n```\n"
        "<!-- docs-test: output -->\n```text\nwrote cat.mp4\n```\n"
        "<!-- docs-test: torchrun 2; timeout 60 -->\n```python\nprint(1)\n```\n"
        "```\nlayout: world_size=2\n```\n"
    )
    skip, session, output, python, other = blocks_in(text, "t.md")
    assert (skip.kind, skip.directives["skip"]) == ("skip", "needs a GPU")
    assert session.commands() == [
        ("hsdp plan tiny-llama --devices 2", ["recommended: [varies]"]),
        ("ls", []),
    ]
    assert (output.kind, python.kind, other.kind) == ("output", "python", "other")
    assert python.directives == {"torchrun": "2", "timeout": "60"}
    with pytest.raises(ValueError, match="without a reason"):
        blocks_in("<!-- docs-test: skip -->\n```bash\nls\n```\n", "t.md")
    with pytest.raises(ValueError, match="unknown docs-test directive"):
        blocks_in("<!-- docs-test: sometimes -->\n```bash\nls\n```\n", "t.md")


def test_docs_tier_matches_printed_lines_in_order():
    from tests.test_docs_run import missing_output

    printed = "INFO load\rprogress\nmodel: /root/.cache/hsdp/tiny-wan, loaded in 4.6s\nhsdp train: a message that\nwraps\n"
    assert (
        missing_output(
            ["model: [varies]/tiny-wan, loaded in [varies]s", "...", "a message that wraps"], printed
        )
        is None
    )
    assert missing_output(["hsdp train: a message", "that wraps"], printed) is None  # the doc wraps a line
    assert missing_output(["a message that wraps", "INFO load"], printed) == "INFO load"  # order matters
    assert missing_output(["loaded in 5.0s"], printed) == "loaded in 5.0s"  # a number that varies must say so


def test_docs_tier_ports_are_distinct_and_outside_the_ephemeral_range():
    """The ports a doc's servers get: never one the kernel may hand to another process meanwhile (serving.md's
    second server once found its port taken), and never the same for two documented ports."""
    from tests.test_docs_run import _ephemeral_low, _free_ports

    ports = _free_ports(3)
    assert len(set(ports)) == 3 and all(1024 <= p < _ephemeral_low() for p in ports), ports


def test_docs_tier_finds_the_files_a_command_writes():
    from tests.test_docs_run import expected_files

    assert expected_files('hsdp generate --model m --prompt "a b" --output cat.mp4') == ["cat.mp4"]
    assert expected_files("curl -s http://x -o cat.mp4 -w '%{http_code}'") == ["cat.mp4"]
    assert expected_files("curl -s http://x | base64 -d > fox.png\ncurl -o /dev/null x") == ["fox.png"]
    assert expected_files("hsdp train --data d --export lora/adapter --output-dir run") == ["lora/adapter"]


def test_docs_tier_says_how_each_command_starts():
    """The inventory's path per command (tests/test_docs_run.py ``block_paths``), which each doc's run checks
    against what its fork server did: bare ``hsdp`` / ``python`` fork, a torchrun forks its agent and each rank, a
    program named by its path or a variable read at import starts a fresh interpreter."""
    from tests.test_docs_run import block_paths, blocks_in

    text = (
        "```bash\nhsdp plan tiny-llama --devices 2 | head -3\n"
        "HSDP_API_KEY=k hsdp serve tiny-llama --port 8092\nHF_HUB_OFFLINE=1 hsdp plan org/x\n"
        "id=$(python -c 'print(1)')\ntorchrun --nproc-per-node 2 -m hsdp.cli train --data x\n"
        ".venv/bin/hsdp --help\npython -X importtime x.py\ncurl -s http://x\n```\n"
        "<!-- docs-test: torchrun 2 -->\n```python\nprint(1)\n```\n"
        "```bash\nsource .venv/bin/activate\nhsdp --help\n```\n"
    )
    shell, torchrun, activated = (block_paths(b) for b in blocks_in(text, "t.md"))
    assert shell == [
        "fork",
        "fork",
        "plain (environment: HF_HUB_OFFLINE read at import)",
        "fork",
        *["fork"] * 3,
        "plain (.venv/bin/hsdp: not the shim)",
        "plain (python option -X)",
    ]
    assert torchrun == ["fork"] * 3 and activated == ["plain (.venv/bin first on PATH)"]
