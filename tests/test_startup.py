"""Issue 34: a command says something at once, before its heavy imports, and ``--log-level debug`` times each
start-up phase."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

# Run as the hsdp command would be: a finder reports when torch starts to import, so the order of the lines on
# stderr shows what the user saw before that import.
_CALLER = """
import sys

class Report:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("IMPORTING torch", file=sys.stderr, flush=True)
            sys.meta_path.remove(self)
        return None

sys.meta_path.insert(0, Report())
from hsdp.cli import main
assert "torch" not in sys.modules, "importing the command line imported torch"
sys.exit(main(sys.argv[1:]))
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _CALLER, *args],
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_first_line_comes_before_torch_is_imported_and_debug_times_each_phase(tmp_path):
    """On main, `hsdp generate` printed nothing until torch, the engine and the pipeline class had imported (17 s
    of a 21 s command); a model folder that is not one is refused by the checks, before any rank starts."""
    out = _run("generate", "--model", str(tmp_path), "--prompt", "a cat", "--log-level", "debug")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert lines[0].endswith("[main] hsdp generate: starting"), lines
    assert lines[1] == "IMPORTING torch", lines
    phases = [line.split("start-up: ", 1)[1].split(" took ")[0] for line in lines if "start-up: " in line]
    assert phases == ["imports (torch and the command's modules)", "checks (the model's folder and pipeline class)"]
    assert f"{tmp_path} is not a model folder" in out.stderr


def test_help_prints_no_start_up_line():
    out = _run("generate", "--help")
    assert out.returncode == 0 and "--log-level" in out.stdout
    assert "starting" not in out.stderr


def test_a_long_phase_is_an_info_line_off_a_terminal(caplog, monkeypatch):
    """Off a terminal (a log file), a phase of :attr:`StartupProgress.LONG_S` or more is an info line; shorter ones
    are debug lines (the per-phase timer)."""
    from hsdp import logging_utils

    monkeypatch.setattr(logging_utils.StartupProgress, "LONG_S", 0.0)
    logger = logging.getLogger("hsdp")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.DEBUG, logger="hsdp"), logging_utils.phase("loading"):
        pass
    # (pytest's capture handler may see a record twice when an earlier test of this process set hsdp's logging up)
    records = [r for r in caplog.records if "start-up: loading took" in r.getMessage()]
    assert records and {r.levelno for r in records} == {logging.INFO}


@pytest.mark.slow
def test_loading_names_each_component_as_the_ranks_finish_it(caplog, monkeypatch, tmp_path, dist_run):
    """The load phase is not one silent block: each component the ranks finish loading is named with its time (a
    bar's postfix on a terminal; a line in a log, info when long)."""
    from hsdp import Engine, logging_utils
    from tests.engine_refs import builtin

    monkeypatch.setattr(logging_utils.StartupProgress, "LONG_S", 0.0)
    monkeypatch.setattr(logging.getLogger("hsdp"), "propagate", True)
    path = builtin("tiny-flux", tmp_path)
    with caplog.at_level(logging.INFO, logger="hsdp"), Engine(path, workers=dist_run.group(1)):
        pass
    loaded = [r.getMessage().strip() for r in caplog.records if r.getMessage().strip().startswith("load: ")]
    # (pytest's capture handler may see a record twice when an earlier test of this process set hsdp's logging up)
    parts = list(dict.fromkeys(line.rsplit(" in ", 1)[0] for line in loaded))
    assert parts == [
        "load: text_encoder_2 (1 of 3)",  # tiny-flux's T5, the component hsdp would shard beside the transformer
        "load: transformer (2 of 3)",
        "load: the other components (whole on each rank) (3 of 3)",
    ], parts
