"""``hsdp serve MODEL``: load the model sharded across local ranks, then serve it over HTTP (uvicorn).

The flags and the model folder are checked and the port is bound before the model loads, so a bad model, layout
or flag, or a port in use, ends the command at once with a message and exit code 2; the server listens once the
model is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from hsdp.cli import (
    ALL_PARALLEL_GROUPS,
    add_parallel_arguments,
    add_single_file_arguments,
    add_source_arguments,
    parallel_config_from_args,
    resolve_model_argument,
)
from hsdp.engine.cli import add_engine_arguments
from hsdp.serve.settings import ServeLimits, ServeSettings

logger = logging.getLogger("hsdp")

API_KEY_ENV = "HSDP_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        help="built-in name (tiny-wan, tiny-llama), a diffusers / Hugging Face model folder, or a Hugging Face Hub "
        "name (org/name)",
    )
    add_source_arguments(parser)
    add_single_file_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8091)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every endpoint but /health (default: ${API_KEY_ENV})",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as 'model' for the base (default: MODEL; adapters go by their --lora NAME)",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=Path("outputs/serve"), help="job records and videos"
    )
    add_engine_arguments(parser)
    adapters = parser.add_argument_group("LoRA adapters (several on one sharded base, chosen per request)")
    adapters.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="adapters held on the ranks at once, least recently used evicted (default: one per --lora)",
    )
    adapters.add_argument(
        "--max-lora-rank",
        type=int,
        default=None,
        help="rank of the adapter slots; adapters of lower rank fit (default: the largest --lora's, else 16)",
    )
    adapters.add_argument(
        "--lora-target-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="the layers adapters loaded at run time may adapt (peft target_modules: names such as to_q ff.net.2, "
        "or all-linear; default all-linear with --lora-root): the slots hold rank x (in + out) fp32 "
        "values per layer, so fewer layers cost less memory; the --lora adapters' layers are always covered",
    )
    adapters.add_argument(
        "--lora-root",
        type=Path,
        default=None,
        help="a request's lora.local_path and POST /v1/load_lora_adapter's lora_path must lie under this folder",
    )
    parser.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429 (default 64)")
    parser.add_argument(
        "--job-timeout", type=float, default=600.0, help="seconds per engine call before the workers restart"
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=120.0,
        help="seconds without a denoising step or token before running workers count as hung (default 120)",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=1,
        help="diffusion: compatible requests (same size, steps, guidance) each rank runs as one batch, one "
        "forward per step for all; results within 1e-5 of running alone (default 1)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="engine runs of a job interrupted by worker failures or restarts before it fails (default 3)",
    )
    limits = parser.add_argument_group("request limits (each violation is a 400 naming the flag)")
    defaults = ServeLimits()
    for name in (
        "max_prompt_chars",
        "max_side",
        "max_frames",
        "max_steps",
        "max_images",
        "max_new_tokens",
        "max_body_bytes",
    ):
        limits.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=getattr(defaults, name),
            help=f"default {getattr(defaults, name)}",
        )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    add_parallel_arguments(parser, groups=ALL_PARALLEL_GROUPS)


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    limit_names = [f.name for f in ServeLimits.__dataclass_fields__.values() if hasattr(args, f.name)]
    return ServeSettings(
        model=args.model,
        parallel_config=parallel_config_from_args(args),
        served_model_name=args.served_model_name,
        output_dir=args.output_dir,
        api_key=args.api_key,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        device_memory=args.device_memory,
        lora=tuple(args.lora or ()),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_root=args.lora_root,
        lora_target_modules=tuple(args.lora_target_modules) if args.lora_target_modules else None,
        host=args.host,
        forward_prefetch=args.forward_prefetch,
        cache=args.cache,
        cache_config=args.cache_config,
        compile=args.compile,
        attention_backend=args.attention_backend,
        vae_parallel=args.vae_parallel,
        vae_tiling=args.vae_tiling,
        vae_slicing=args.vae_slicing,
        step_timeout_s=args.step_timeout,
        max_attempts=args.max_attempts,
        max_batch_size=args.max_batch_size,
        max_queue=args.max_queue,
        job_timeout_s=args.job_timeout,
        limits=ServeLimits(**{name: getattr(args, name) for name in limit_names}),
    )


def run(args: argparse.Namespace) -> int:
    """Serve on local ranks, or, under ``torchrun``, over every rank of the job: global rank 0 serves HTTP and
    leads the engine, the other ranks follow it headless (:mod:`hsdp.engine.leader`)."""
    from hsdp import distributed

    resolve_model_argument(args)  # a hub name: downloaded (once per node) before the engine starts
    if args.model != args.model_name and not args.served_model_name:
        args.served_model_name = args.model_name  # clients keep using the name given, not the snapshot's path
    if not distributed.launched_by_torchrun():
        return _serve(args, None)
    from hsdp.engine.leader import LeaderRanks, follow

    distributed.init_distributed()
    if distributed.rank() != 0:
        return follow()
    leader = LeaderRanks()
    try:
        return _serve(args, leader)
    finally:
        leader.close()


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a busy port or an address this host lacks ends the
    command at once, and no other process takes the port while the model loads. ``SO_REUSEADDR`` as uvicorn
    sets it (a port whose last connections linger in TIME_WAIT is free). The protocol is named (TCP), not left 0:
    asyncio turns Nagle's algorithm off only on connections whose socket says TCP, and with it on, every answer
    after the first on a kept-alive connection waited ~40 ms for the client's delayed ACK between its headers and
    its body."""
    if not 0 <= port < 65536:
        raise ValueError(f"--port {port} must be 0..65535")
    try:
        family, kind, proto, _, _ = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"--host {host}: not an address of this machine ({exc})") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"--port {port} on {host}: cannot listen there ({exc}); stop what uses it or pick another --port"
        ) from exc
    return sock


def _answer_sync_requests_on_exit(http, server) -> None:
    """Global rank 0 under torchrun: SIGTERM (or SIGINT) there means torchrun is stopping every rank (a restart
    after a rank's loss, or the job's end), so the running engine call cannot finish and this process will not
    serve again. The synchronous requests are answered at once (503 with ``Retry-After``,
    :meth:`hsdp.serve.service.Server.expect_torchrun_restart`), before uvicorn's graceful shutdown, which would
    otherwise hold their connections until torchrun kills the process."""
    handle_exit = http.handle_exit  # uvicorn installs it as the signal handler when it starts

    def on_exit(sig: int, frame) -> None:
        # In a thread, not in this signal handler: the job store's lock may be held by the code it interrupted.
        why = "torchrun is stopping every rank (a restart, or the job's end)"
        threading.Thread(target=server.expect_torchrun_restart, args=(why,), daemon=True).start()
        handle_exit(sig, frame)

    http.handle_exit = on_exit


@contextlib.contextmanager
def _sigterm_as_ctrl_c(leader):
    """SIGTERM (systemd's stop, ``timeout``, ``kill``) stops the server as Ctrl-C does: uvicorn shuts down on
    either and then raises it again, and SIGTERM's default would end the process there, before the running batch
    finishes and the ranks are told to stop. Not under torchrun, whose SIGTERM stops every rank at once."""
    if leader is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve(args: argparse.Namespace, leader) -> int:
    import uvicorn
    from uvicorn.main import STARTUP_FAILURE

    from hsdp.launch import WorkerError
    from hsdp.serve.app import create_app
    from hsdp.serve.service import Server

    settings = settings_from_args(args)
    try:
        server = Server(settings, workers=leader)  # checks what needs no loading
        sock = _bind(args.host, args.port)
    except (ValueError, FileNotFoundError) as exc:
        print(f"hsdp serve: {exc}", file=sys.stderr)
        return 2
    try:
        server.start()
    except (ValueError, FileNotFoundError) as exc:
        sock.close()
        print(f"hsdp serve: {exc}", file=sys.stderr)
        return 2
    except WorkerError as exc:
        sock.close()
        print(f"hsdp serve: the workers failed while loading the model: {exc}", file=sys.stderr)
        return 1
    if args.host not in ("127.0.0.1", "localhost", "::1") and not settings.api_key:
        logger.warning(
            "serving on %s without --api-key: anyone who can reach this address can use the model", args.host
        )
    logger.info(
        "serving %s (%s) on http://%s:%d; outputs in %s",
        settings.name,
        settings.parallel_config.describe(),
        args.host,
        sock.getsockname()[1],
        settings.output_dir,
    )
    config = uvicorn.Config(create_app(server), log_level=args.log_level, timeout_graceful_shutdown=30)
    http = uvicorn.Server(config)
    if leader is not None:
        _answer_sync_requests_on_exit(http, server)
    try:
        with _sigterm_as_ctrl_c(leader):
            http.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn raises the SIGINT (or SIGTERM) it shut down on again, as uvicorn.run expects
        pass
    finally:
        sock.close()
        server.stop()
    return 0 if http.started else STARTUP_FAILURE
