"""The ``hsdp`` command's contract: each subcommand offers only the flags it uses, and every error that escapes
a subcommand ends it the same way (message ``hsdp <cmd>: ...`` and one exit code per kind of failure)."""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import types

import pytest

from hsdp import cli
from hsdp.config import ConfigError
from hsdp.errors import exit_code, format_problem
from hsdp.launch import WorkerError, WorkerTimeout

# main() runs fake commands and refusals found before any rank starts.
pytestmark = pytest.mark.unit

INFERENCE_ONLY_FLAGS = ("--request-parallel", "--cfg-parallel-size", "--ring-degree")


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args([*argv, "--help"])
    assert exited.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_subcommand_help_parses(command: str):
    assert f"usage: hsdp {command}" in _help(command)


def test_train_help_lists_only_training_parallel_flags():
    text = _help("train")
    for flag in INFERENCE_ONLY_FLAGS:
        assert flag not in text
    for flag in ("--use-hsdp", "--hsdp-shard-size", "--strategy", "--cpu-offload", "--offload-layers", "--tensor-parallel-size"):
        assert flag in text
    assert "--ulysses-degree" in text and "--usp" in text  # diffusion denoisers train sequence-parallel


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_inference_commands_keep_every_parallel_flag(command: str):
    text = _help(command)
    for flag in INFERENCE_ONLY_FLAGS:
        assert flag in text


def test_train_refuses_inference_only_flags():
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(["train", "--data", "x.txt", "--request-parallel"])
    assert exited.value.code == 2


def test_absent_flag_groups_keep_config_defaults():
    parser = argparse.ArgumentParser()
    cli.add_parallel_arguments(parser, groups=("sharding",))
    config = cli.parallel_config_from_args(parser.parse_args(["--use-hsdp", "--hsdp-shard-size", "2"]))
    assert (config.hsdp_shard_size, config.ulysses_degree, config.cfg_parallel_size) == (2, 1, 1)
    assert (config.tensor_parallel_size, config.request_parallel) == (1, False)


def test_unknown_subcommand_exits_2():
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as exited:
        cli.main(["generat"])
    assert exited.value.code == 2


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (ValueError("--steps must be positive"), 2, "hsdp fake: --steps must be positive"),
        (ConfigError(["--cfg-parallel-size=3: use 1 or 2"]), 2, "hsdp fake: Invalid parallel configuration"),
        (FileNotFoundError("no such model 'x'"), 2, "hsdp fake: no such model 'x'"),
        (WorkerError("rank 1 raised"), 1, "hsdp fake: rank 1 raised"),
        (WorkerTimeout("rank 0 timed out"), 1, "hsdp fake: rank 0 timed out"),
        (KeyboardInterrupt(), 130, "hsdp fake: interrupted"),
    ],
)
def test_error_exit_codes(monkeypatch, capsys, error: BaseException, code: int, message: str):
    _fake_command(monkeypatch, error)
    assert cli.main(["fake"]) == code
    started, problem = capsys.readouterr().err.split("\n", 1)  # the line a command prints at once, then its problem
    assert started.endswith("hsdp fake: starting") and problem.startswith(message)


def test_a_bug_keeps_its_traceback(monkeypatch):
    _fake_command(monkeypatch, RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["fake"])
    with pytest.raises(TypeError, match="should propagate"):
        exit_code(RuntimeError("a bug"))


def test_problem_list_stays_on_its_own_lines():
    error = ConfigError(["--cfg-parallel-size=3: use 1 or 2", "--ring-degree=0: use 1 or more"])
    assert format_problem("demo", error).splitlines() == [
        "hsdp demo: Invalid parallel configuration (2 problem(s)):",
        "  - --cfg-parallel-size=3: use 1 or 2",
        "  - --ring-degree=0: use 1 or more",
    ]


def test_real_config_and_missing_model_errors_exit_2(capsys):
    """Through a real subcommand: both are found before any worker process starts."""
    assert (
        cli.main(["demo", "--hsdp-shard-size", "3", "--ulysses-degree", "2", "--cfg-parallel-size", "3"]) == 2
    )
    assert "hsdp demo: Invalid parallel configuration" in capsys.readouterr().err
    assert cli.main(["demo", "--model", "/nonexistent/model"]) == 2
    assert "hsdp demo: model '/nonexistent/model' is neither" in capsys.readouterr().err


def _fake_command(monkeypatch, error: BaseException) -> None:
    """Register ``hsdp fake``, whose run raises ``error``."""

    def run(args: argparse.Namespace) -> int:
        raise error

    module = types.ModuleType("_hsdp_fake_command")
    module.add_arguments = lambda parser: None
    module.run = run
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, "fake", (module.__name__, "raises the error under test"))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", "--model", "tiny-wan", "--prompt", "x", "--pipeline-kwargs", "[1]"], "--pipeline-kwargs: '[1]' is JSON but not an object (list)"),
        (["serve", "tiny-wan", "--cache-config", '"x"'], "--cache-config: '\"x\"' is JSON but not an object (str)"),
        (["generate", "--model", "tiny-wan", "--prompt", "x", "--cache-config", "{x"], "--cache-config: '{x' is not valid JSON"),
    ],
)
def test_json_flags_take_an_object(argv, needle):
    """Valid JSON that is not an object is refused by the parser, naming the flag (issue 27 item 12: a traceback)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        cli.build_parser().parse_args(argv)
    assert exited.value.code == 2 and needle in err.getvalue()


def test_a_command_imports_only_its_own_subcommand_module(monkeypatch, capsys):
    """``hsdp plan`` builds the parser of ``plan`` only: the other subcommands' modules (the engine, the trainer
    with torch's DCP) are not imported, as every ``hsdp`` command once paid for."""
    imported = []
    real = cli.importlib.import_module
    monkeypatch.setattr(cli, "importlib", types.SimpleNamespace(import_module=lambda n: imported.append(n) or real(n)))
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--help"])
    assert exited.value.code == 0 and "--device-memory" in capsys.readouterr().out
    assert imported == ["hsdp.planning.cli"]


def _flat_help(command: str) -> str:
    return " ".join(_help(command).split())  # argparse wraps lines; compare words


def test_generate_output_help_lists_every_format_written():
    """``--output`` listed no audio format while ``hsdp generate`` writes .wav, .flac and .mp3 (issue 34)."""
    from hsdp.engine.outputs import SUFFIXES

    text = _flat_help("generate")
    help_line = text[text.rindex("--output OUTPUT") :][:400]  # the options list, after the usage line
    for kind, suffixes in SUFFIXES.items():
        for suffix in suffixes:
            assert suffix in help_line, (kind, suffix, help_line)


def test_train_help_describes_diffusion_data_and_targets():
    """``hsdp train --help`` described ``--data`` and ``--lora-target-modules`` for causal LMs only (issue 34)."""
    from hsdp.train.diffusion.trainer import DEFAULT_LORA_TARGETS

    text = _flat_help("train")
    data = text[text.rindex("--data DATA") :][:400]
    assert "diffusers pipeline" in data and "folder of images or videos" in data and "metadata.jsonl" in data
    targets = text[text.rindex("--lora-target-modules NAME") :][:300]
    assert "causal LM" in targets and all(name in targets for name in DEFAULT_LORA_TARGETS), targets


@pytest.mark.parametrize("doc", ["serving.md", "inference.md"])
def test_docs_say_wan22_takes_lora_and_name_the_test_that_shows_it(doc):
    """docs/serving.md said a pipeline with two denoisers (Wan 2.2) takes no LoRA, docs/inference.md that it is
    refused, while tests/test_lora_formats.py serves and generates with an adapter on each expert (issue 34)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = " ".join((root / "docs" / doc).read_text().split())
    assert "(Wan2.2) takes none" not in text and "(Wan 2.2) are refused" not in text
    named = "test_serve_lora_applies_both_experts" if doc == "serving.md" else "test_generate_lora_applies_both_experts"
    assert "Wan 2.2 A14B) takes an adapter for both experts" in text and named in text
    assert f"def {named}(" in (root / "tests" / "test_lora_formats.py").read_text()
