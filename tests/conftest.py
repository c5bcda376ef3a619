"""Shared fixtures. Multi-rank tests run module-level functions on a reused :class:`hsdp.launch.WorkerGroup`.

``dist_run(world_size, fn, *args)`` runs ``fn`` on every rank of a group of that size and returns the per-rank
results. One group per world size is kept for the whole session (process start-up and imports cost seconds);
a group that broke (a rank raised, died or timed out) is replaced before the next test.

Test tiers (``bash scripts/test.sh -m unit``): every test gets one of the markers ``unit``, ``multirank``, ``gpu``,
``docs`` (``tests/test_docs_run.py``: runs the commands of README.md and docs/) or ``compose`` (the combination
tier, ``tests/test_compose.py``: pairwise cases of the feature axes of ``tests/compose_axes.py``). A test marked with one of them
keeps it; otherwise it is ``multirank`` when it uses ``dist_run`` or when
its code, the fixtures it uses or the test helpers they call name something that starts processes
(:data:`PROCESS_STARTERS`), and ``unit`` when not. The scan reads names, not behaviour, so it errs towards
``multirank``: a test that only checks that ``Engine(...)`` refuses a bad layout is counted multirank too.
"""

from __future__ import annotations

import inspect
import json
import os
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from hsdp.launch import WorkerGroup
from tests.browser import browser, page  # noqa: F401  (the served pages' tests: a headless Chromium tab)

os.environ.setdefault("HSDP_COLLECTIVE_TIMEOUT", "120")
CALL_TIMEOUT_S = 300


class DistRunner:
    def __init__(self) -> None:
        self._groups: dict[int, WorkerGroup] = {}

    def group(self, world_size: int) -> WorkerGroup:
        group = self._groups.get(world_size)
        if group is None or group.broken:
            # Two cores: keep at most one idle group alive so ranks do not compete for CPU.
            self.close()
            group = self._groups[world_size] = WorkerGroup(world_size, collective_timeout_s=120)
        return group

    def __call__(self, world_size: int, fn, *args, timeout_s: float = CALL_TIMEOUT_S, **kwargs):
        return self.group(world_size).run(fn, *args, timeout_s=timeout_s, **kwargs)

    def close(self) -> None:
        for group in self._groups.values():
            group.close()
        self._groups.clear()


@pytest.fixture(scope="session")
def dist_run():
    runner = DistRunner()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def media(tmp_path_factory):
    """The diffusion training tests' data: four captioned images of different shapes (two buckets at resolution
    32), written once per session (a test file may define its own)."""
    from tests.diffusion_train_fns import write_media

    folder = tmp_path_factory.mktemp("media")
    write_media(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Built-in tiny models saved as real safetensors checkpoints (fp32 and bf16), shared by the session."""
    from tests.checkpoints import write_tiny_checkpoints

    return write_tiny_checkpoints(tmp_path_factory.mktemp("ckpt"))


TIERS = ("unit", "multirank", "gpu", "docs", "compose")
# Names whose use starts worker ranks, a server or a subprocess: the launcher, the classes and entry points that
# spawn it (``main`` / ``cli_main``: the hsdp command), and subprocess itself (torchrun, ``python -m hsdp.cli``).
PROCESS_STARTERS = frozenset(
    {"WorkerGroup", "Engine", "Server", "LocalServer", "run_training", "main", "cli_main", "subprocess"}
)


def _names(code: types.CodeType) -> set[str]:
    """Global and attribute names a function's code (nested functions included) refers to."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _starts_processes(fn: Callable, seen: set[types.CodeType]) -> bool:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None or code in seen:
        return False
    seen.add(code)
    names = _names(code)
    if names & PROCESS_STARTERS:
        return True
    # Follow helpers of our own test modules (a test calling ``_serve(...)`` that starts the server).
    helpers = (fn.__globals__.get(name) for name in names)
    return any(
        _starts_processes(h, seen)
        for h in helpers
        if inspect.isfunction(h) and h.__module__.startswith("tests")
    )


def _tier(item: pytest.Item) -> str:
    if "dist_run" in getattr(item, "fixturenames", ()):
        return "multirank"
    seen: set[types.CodeType] = set()
    fixture_defs = getattr(item, "_fixtureinfo", None)
    fixtures = [
        d.func
        for defs in (fixture_defs.name2fixturedefs.values() if fixture_defs else ())
        for d in defs
        if d.func.__module__.startswith("tests")
    ]
    functions = [getattr(item, "function", None), *fixtures]
    return "multirank" if any(f and _starts_processes(f, seen) for f in functions) else "unit"


SPREAD_FILES = frozenset({"tests/test_docs_run.py"})
"""Files whose tests each make a group of their own: the docs tier's docs each run in a fresh folder and share
nothing, so they spread over the workers."""


def _worker_group(nodeid: str) -> str:
    """The group of workers' work a test belongs to (scripts/test.sh's ``--dist loadgroup``, scheduled by
    :func:`pytest_xdist_make_scheduler`): its file, so that a module's fixtures (servers, engines, the combination
    tier's hosts) are built once and a file's tests never run on two workers at once; :data:`SPREAD_FILES` aside."""
    file = nodeid.split("::")[0]
    return nodeid if file in SPREAD_FILES else file


DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_TEST_S = {"unit": 0.5, "multirank": 6.0, "gpu": 0.5, "compose": 20.0, "docs": 40.0}
"""Seconds assumed per test, by tier, for a group that tests/durations.json does not know (a new file)."""


def _guess_seconds(item: pytest.Item) -> float:
    return max(DEFAULT_TEST_S[tier] if item.get_closest_marker(tier) else 0.0 for tier in TIERS)


def _group_seconds(groups: dict[str, list[pytest.Item]]) -> dict[str, float]:
    """Each group's expected worker time: tests/durations.json (written from a run's junit XML by
    ``python scripts/durations.py``), else a guess from its tests' tiers (:data:`DEFAULT_TEST_S`)."""
    try:
        known = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        known = {}
    return {
        name: float(known[name]) if name in known else sum(map(_guess_seconds, members))
        for name, members in groups.items()
    }


def _longest_groups_first(items: list[pytest.Item]) -> None:
    """Order the groups longest first, each group's tests in their own order. pytest-xdist hands out groups in
    collection order (scripts/test.sh), so each worker takes the longest group left when it is free: a 140 s doc
    no longer starts last, with one worker idle while the other runs it alone."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(_worker_group(item.nodeid), []).append(item)
    seconds = _group_seconds(groups)
    items[:] = [item for name in sorted(groups, key=lambda g: -seconds[g]) for item in groups[name]]


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist would sort the groups by number of tests (single-test groups, the docs, last); keep ours.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadgroup`` by :func:`_worker_group`, in collection order (:func:`_longest_groups_first`).
    pytest-xdist's own loadgroup reads a test's group from a suffix it writes into the test's node id, which pytest
    9.2 no longer reads back (``Node.nodeid`` comes from ``_id``; xdist 3.8 writes ``_nodeid``): every test was a
    group of its own, a file's module fixtures were built on both workers, and test_slurm.py's two tests started
    two SLURM clusters at once whose first jobs took the same rendezvous port (EADDRINUSE). The controller sees
    node ids only, so the group comes from the id."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _worker_group(nodeid)

    return ByGroup(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(_tier(item))
    _longest_groups_first(items)


# Signals the tests send to the commands they start (Ctrl-C's SIGINT, a scheduler's SIGTERM) reach them only if the
# test process holds them as a terminal's shell would: a child inherits an ignored disposition and a blocked mask
# across exec. A non-interactive shell starts `cmd &` with SIGINT ignored (POSIX: no job control), so a suite started
# in the background hands every `hsdp` it runs an ignored SIGINT: Ctrl-C never arrived in both CI workers once
# (issue 37 item 5). Restored here for the whole run; a test that changes either and leaves it changed fails.
_TEST_SIGNALS = ("SIGINT", "SIGTERM")


def _signal_state() -> tuple:
    import signal

    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return tuple((name, signal.getsignal(getattr(signal, name)), getattr(signal, name) in blocked) for name in _TEST_SIGNALS)


def _terminal_sigint() -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM])


_terminal_sigint()



# torchrun runs its ranks `python -u`: tests/forked_cli.preloaded_python's fork server takes them when its environment,
# which it copies from this process's, has it too (tests/docs_forkserver.py's check)
os.environ.setdefault("PYTHONUNBUFFERED", "1")


def _servers_start_forked() -> None:
    """Each :class:`~hsdp.serve.local.LocalServer`'s ``hsdp serve``, and the torchrun agents and ranks of each
    :class:`~hsdp.serve.local.LocalNodes`, run forked from a fork server with torch and the model libraries imported
    (tests/forked_cli.preloaded_python: ~5 s of CPU per process otherwise), unless the environment differs in what a
    library reads at import; ``HSDP_TEST_SUBPROCESS=1`` starts fresh interpreters."""
    from hsdp.serve.local import LocalNodes, LocalServer
    from tests.forked_cli import command_process, preloaded_python

    LocalServer.python = LocalNodes.python = staticmethod(preloaded_python)
    LocalNodes.process_of = staticmethod(command_process)


_servers_start_forked()


@pytest.fixture(autouse=True)
def _signals_left_as_found():
    before = _signal_state()
    yield
    after = _signal_state()
    if after != before:
        import signal

        for name, handler, blocked in before:
            signal.signal(getattr(signal, name), handler)
            how = signal.SIG_BLOCK if blocked else signal.SIG_UNBLOCK
            signal.pthread_sigmask(how, [getattr(signal, name)])
        pytest.fail(f"the test left the signal handling changed (name, handler, blocked): {before} -> {after}")
