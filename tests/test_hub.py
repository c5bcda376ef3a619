"""Hugging Face Hub names (issue 35 item 1), offline: a tiny repository served by :mod:`tests.hub_server` on
127.0.0.1 (``HF_ENDPOINT``), downloaded by ``huggingface_hub`` itself into a cache in the hub's own layout
(``models--org--tiny-wan/snapshots/<commit>/...``), then every command resolves ``org/tiny-wan`` from that cache with
``HF_HUB_OFFLINE=1``. Commands run as subprocesses: ``huggingface_hub`` reads its environment when imported."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hsdp.models.builtin import resolve_model
from hsdp.models.hub import pipeline_files
from tests.hub_server import COMMIT, LocalHub

ROOT = Path(__file__).resolve().parents[1]
REPO = "org/tiny-wan"
DECOYS = {
    "decoy.bin": b"x" * 64,  # a file at the root that nothing names
    "wan_single_file.safetensors": b"x" * 64,  # another format of the same model
    "transformer/diffusion_pytorch_model.fp16.safetensors": b"x" * 64,  # a variant
    "transformer/diffusion_pytorch_model.bin": b"x" * 64,  # the same weights as .bin
    "onnx/model.onnx": b"x" * 64,  # a folder model_index.json does not name
}


@pytest.fixture(scope="module")
def repo_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("repo") / "tiny-wan"
    shutil.copytree(resolve_model("tiny-wan"), folder, ignore=shutil.ignore_patterns(".complete"))
    for name, data in DECOYS.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return folder


def _env(cache: Path, endpoint: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", HF_HUB_CACHE=str(cache), HF_HUB_DISABLE_TELEMETRY="1")
    env["HF_ENDPOINT"] = endpoint or "http://127.0.0.1:9"  # offline runs: nothing listens there
    env.update(extra)
    return env


def _hsdp(*argv: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hsdp.cli", *argv], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


@pytest.fixture(scope="module")
def offline_cache(repo_folder, tmp_path_factory) -> Path:
    """A Hugging Face cache holding ``org/tiny-wan``, written by ``huggingface_hub``'s own download."""
    cache = tmp_path_factory.mktemp("hf-cache")
    with LocalHub(REPO, repo_folder) as hub:
        done = _hsdp("download", REPO, env=_env(cache, hub.endpoint))
    assert done.returncode == 0, done.stderr
    return cache


def test_pipeline_files_are_what_the_pipeline_loads(repo_folder):
    files = sorted(p.relative_to(repo_folder).as_posix() for p in repo_folder.rglob("*") if p.is_file())
    index = json.loads((repo_folder / "model_index.json").read_text())
    chosen = pipeline_files(files, index)
    assert not set(chosen) & set(DECOYS)
    assert "transformer/diffusion_pytorch_model.safetensors" in chosen and "model_index.json" in chosen
    assert "tokenizer/tokenizer.json" in chosen and "scheduler/scheduler_config.json" in chosen
    # a folder with no safetensors loads its .bin files; a transformers model: the root's configs and weights
    assert pipeline_files(["m/config.json", "m/pytorch_model.bin", "model_index.json"], {"m": ["x", "Y"]}) == [
        "model_index.json", "m/config.json", "m/pytorch_model.bin"]  # fmt: skip
    lm = ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
          "model.safetensors.index.json", "pytorch_model.bin", "original/consolidated.pth", "tokenizer.json"]  # fmt: skip
    assert sorted(pipeline_files(lm, None)) == sorted(set(lm) - {"pytorch_model.bin", "original/consolidated.pth"})


def test_download_once_per_node_only_the_pipeline_files(repo_folder, tmp_path):
    """Two processes of one node (what torchrun starts) download at once: each file is fetched once, by one of
    them, with a progress bar; the other waits on the lock and finds the snapshot; no decoy is ever requested."""
    with LocalHub(REPO, repo_folder) as hub:
        env = _env(tmp_path / "cache", hub.endpoint)
        argv = [sys.executable, "-m", "hsdp.cli", "download", REPO]
        procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(2)]  # fmt: skip
        outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    snapshot = tmp_path / "cache" / "models--org--tiny-wan" / "snapshots" / COMMIT
    assert {o.strip().splitlines()[-1] for o, _ in outs} == {str(snapshot)}
    assert any("Fetching" in err for _, err in outs)  # huggingface_hub's progress bar
    files = sorted(p.relative_to(repo_folder).as_posix() for p in repo_folder.rglob("*") if p.is_file())
    wanted = set(files) - set(DECOYS)
    assert {f for f in files if hub.downloads(f)} == wanted
    assert all(hub.downloads(f) == 1 for f in wanted - {"model_index.json"}), hub.requests
    assert not [r for r in hub.requests if any(r[1].endswith(d) for d in DECOYS)]
    for name in wanted:
        assert (snapshot / name).read_bytes() == (repo_folder / name).read_bytes()


def test_a_killed_download_resumes(repo_folder, tmp_path):
    """The connection dies half-way through the denoiser's weights: the download goes on from the bytes it has
    (a Range request), not from the start. huggingface_hub writes 10 MiB chunks; 4 KiB here, so a tiny file
    leaves some behind."""
    big = "transformer/diffusion_pytorch_model.safetensors"
    small_chunks = "import sys; from huggingface_hub import constants; constants.DOWNLOAD_CHUNK_SIZE = 4096; "
    small_chunks += "from hsdp.cli import main; sys.exit(main(sys.argv[1:]))"
    with LocalHub(REPO, repo_folder) as hub:
        hub.cut_once.add(big)
        done = subprocess.run([sys.executable, "-c", small_chunks, "download", REPO], capture_output=True, text=True,
                              env=_env(tmp_path / "cache", hub.endpoint), timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    gets = [r for r in hub.requests if r[0] == "GET" and r[1].endswith(big)]
    size = (repo_folder / big).stat().st_size
    assert len(gets) == 2 and gets[0][2] is None, gets
    resumed_at = int(gets[1][2].removeprefix("bytes=").removesuffix("-"))
    assert 0 < resumed_at <= size // 2, gets  # the second GET asks for the rest only
    assert Path(done.stdout.strip().splitlines()[-1], big).read_bytes() == (repo_folder / big).read_bytes()


@pytest.mark.parametrize(
    "hub_kwargs, argv, message",
    [
        ({"token": "secret"}, [], "the hub has no such repository, or it is private and no HF_TOKEN is set (HTTP 401)"),
        ({"gated": True}, [], "is gated: the hub refused access (HTTP 403); accept its license"),
        ({}, ["--revision", "v9"], "the repository has no revision 'v9'; pass --revision a branch, tag or commit"),
    ],
)
def test_hub_errors_say_what_to_do(repo_folder, tmp_path, hub_kwargs, argv, message):
    with LocalHub(REPO, repo_folder, **hub_kwargs) as hub:
        done = _hsdp("download", REPO, *argv, env=_env(tmp_path / "cache", hub.endpoint))
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    if hub_kwargs.get("token"):  # with the token, the same repository downloads
        with LocalHub(REPO, repo_folder, **hub_kwargs) as hub:
            done = _hsdp("download", REPO, env=_env(tmp_path / "cache", hub.endpoint, HF_TOKEN="secret"))
        assert done.returncode == 0, done.stderr


def test_offline_and_not_cached(tmp_path):
    done = _hsdp("generate", "--model", REPO, "--prompt", "x", env=_env(tmp_path / "empty", None, HF_HUB_OFFLINE="1"))
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert f"model '{REPO}' is not in the Hugging Face cache {tmp_path / 'empty'} and HF_HUB_OFFLINE=1" in done.stderr
    assert f"run `hsdp download {REPO}`" in done.stderr


def test_generate_from_a_hub_name_offline_equals_diffusers(offline_cache, tmp_path):
    """``hsdp generate --model org/tiny-wan`` at HSDP 2 with HF_HUB_OFFLINE=1 loads the cached snapshot, and its
    video equals diffusers' pipeline from that snapshot in one process."""
    import imageio.v3 as iio

    from hsdp.engine.outputs import save_frames
    from tests.engine_refs import reference_pipeline

    env = _env(offline_cache, None, HF_HUB_OFFLINE="1")
    args = ["--prompt", "a cat", "--seed", "3", "--num-inference-steps", "2", "--use-hsdp", "--hsdp-shard-size", "2"]
    done = _hsdp("generate", "--model", REPO, *args, "--output", str(tmp_path / "hub.gif"), env=env)
    assert done.returncode == 0, done.stderr
    snapshot = offline_cache / "models--org--tiny-wan" / "snapshots" / COMMIT
    defaults = json.loads((snapshot / "hsdp_defaults.json").read_text())  # the built-in's size, as the engine reads
    call = {k: v for k, v in defaults.items() if k != "num_inference_steps"}
    frames = reference_pipeline(snapshot, "a cat", 3, num_inference_steps=2, **call)
    save_frames(frames, tmp_path / "ref.gif")
    np.testing.assert_array_equal(iio.imread(tmp_path / "hub.gif"), iio.imread(tmp_path / "ref.gif"))


def test_plan_serve_train_resolve_a_hub_name_offline(offline_cache, tmp_path):
    env = _env(offline_cache, None, HF_HUB_OFFLINE="1")
    snapshot = offline_cache / "models--org--tiny-wan" / "snapshots" / COMMIT
    hub_plan = _hsdp("plan", REPO, "--devices", "2", "--json", env=env)
    folder_plan = _hsdp("plan", str(snapshot), "--devices", "2", "--json", env=env)
    assert hub_plan.returncode == 0 and folder_plan.returncode == 0, hub_plan.stderr
    assert json.loads(hub_plan.stdout) == json.loads(folder_plan.stdout)
    # serve resolves and checks the model before binding its port: a port in use stops it after resolution
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        served = _hsdp("serve", REPO, "--port", str(port), env=env)
    assert served.returncode == 2 and f"--port {port} on 127.0.0.1: cannot listen" in served.stderr, served.stderr
    assert "is not in the Hugging Face cache" not in served.stderr
    trained = _hsdp("train", "--model", REPO, "--data", str(tmp_path / "missing"), "--steps", "1", env=env)
    assert trained.returncode == 2 and "missing" in trained.stderr, trained.stderr
    assert "Hugging Face" not in trained.stderr and "neither an existing path" not in trained.stderr


def test_plan_of_a_hub_name_reads_only_configs_and_headers(repo_folder, tmp_path):
    """Online, ``hsdp plan ORG/NAME`` fetches configs and the safetensors headers (range requests), never the
    weights, and plans exactly as from the downloaded folder."""
    with LocalHub(REPO, repo_folder) as hub:
        env = _env(tmp_path / "cache", hub.endpoint, HSDP_CACHE=str(tmp_path / "hsdp-cache"))
        done = _hsdp("plan", REPO, "--devices", "2", "--json", env=env)
    assert done.returncode == 0, done.stderr
    weights = [r for r in hub.requests if r[0] == "GET" and r[1].endswith(".safetensors")]
    assert weights and all(r[2] and r[2].startswith("bytes=0-") for r in weights), weights  # headers only
    assert not list((tmp_path / "cache").rglob("*.safetensors"))  # no weights in the Hugging Face cache
    local = _hsdp("plan", str(repo_folder), "--devices", "2", "--json", env=env)
    assert json.loads(done.stdout) == json.loads(local.stdout)
    # offline afterwards: the plan again from those headers; a command that loads weights says they are not cached
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    again = _hsdp("plan", REPO, "--devices", "2", "--json", env=offline)
    assert again.returncode == 0 and json.loads(again.stdout) == json.loads(local.stdout), again.stderr
    refused = _hsdp("download", REPO, env=offline)
    assert refused.returncode == 2 and "lacks ['text_encoder', 'transformer', 'vae'] or their weights" in refused.stderr
    assert "only what `hsdp plan` fetched" in refused.stderr, refused.stderr


def test_load_pretrained_takes_a_hub_name(offline_cache):
    """The library: ``load_pretrained("org/name", subfolder=...)`` and ``resolve_model`` (what ``Engine`` calls) read the cached
    snapshot offline; a revision the cache does not hold is an error naming it."""
    script = (
        "import torch; from hsdp.loading import load_pretrained; from hsdp.models.builtin import resolve_model\n"
        f"m = load_pretrained({REPO!r}, subfolder='transformer', dtype=torch.float32)\n"
        f"print(sum(p.numel() for p in m.parameters()), resolve_model({REPO!r}).name)\n"
        f"try:\n    resolve_model({REPO!r}, revision='v9')\nexcept FileNotFoundError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=_env(offline_cache, None, HF_HUB_OFFLINE="1"),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    count, name = done.stdout.splitlines()[0].split()
    from safetensors.torch import load_file

    stored = sum(t.numel() for t in load_file(resolve_model("tiny-wan") / "transformer" / "diffusion_pytorch_model.safetensors").values())
    assert int(count) == stored and name == COMMIT
    assert "model 'org/tiny-wan' at revision 'v9' is not in the Hugging Face cache" in done.stdout


def test_an_unreachable_hub_falls_back_to_the_cache(offline_cache, tmp_path):
    """No network and HF_HUB_OFFLINE unset (the endpoint refuses connections): the cached snapshot serves, as in
    diffusers and transformers; with nothing cached, the message says so instead of a traceback."""
    done = _hsdp("download", REPO, env=_env(offline_cache, None))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(offline_cache / "models--org--tiny-wan" / "snapshots" / COMMIT)
    empty = _hsdp("download", REPO, env=_env(tmp_path / "empty", None))
    assert empty.returncode == 2 and "Traceback" not in empty.stderr, empty.stderr
    assert f"model '{REPO}': cannot reach the hub at http://127.0.0.1:9" in empty.stderr


def test_a_disk_that_fills_while_downloading_leaves_nothing_used_later(repo_folder, tmp_path, monkeypatch):
    """The cache's disk fills half-way through the denoiser's weights (simulated by a file size limit,
    ``RLIMIT_FSIZE``, on the downloading process): a message that says what to do, no partial file in the cache;
    offline, the cached snapshot is refused as incomplete; the next download fetches only what is missing."""
    big = "transformer/diffusion_pytorch_model.safetensors"
    limit = (repo_folder / big).stat().st_size // 2
    assert all(p.stat().st_size < limit for p in repo_folder.rglob("*.json"))  # only weights hit the limit
    limited = "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
    limited += f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); "
    limited += "from huggingface_hub import constants; constants.DOWNLOAD_CHUNK_SIZE = 4096; "
    limited += "from hsdp.cli import main; sys.exit(main(sys.argv[1:]))"
    cache = tmp_path / "cache"
    with LocalHub(REPO, repo_folder) as hub:
        full = subprocess.run([sys.executable, "-c", limited, "download", REPO], capture_output=True, text=True,
                              env=_env(cache, hub.endpoint), timeout=300)  # fmt: skip
        assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr
        assert "File too large: the disk or a size limit is full). Nothing half-written is kept" in full.stderr
        assert not list(cache.rglob("*.incomplete")) and not list(cache.rglob(big))
        fetched = {r[1] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]}
        from huggingface_hub import constants

        from hsdp.models.hub import HubError, _cached_snapshot

        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # what HF_HUB_OFFLINE=1 runs would resolve
        with pytest.raises(HubError, match=r"the cached snapshot .* lacks \[.*'transformer'"):
            _cached_snapshot(REPO, None)
        hub.requests.clear()
        again = _hsdp("download", REPO, env=_env(cache, hub.endpoint))
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip().splitlines()[-1], big).read_bytes() == (repo_folder / big).read_bytes()
    refetched = {r[1] for r in hub.requests if r[0] == "GET" and "/resolve/" in r[1]}
    assert any(p.endswith(big) for p in refetched) and len(refetched) < len(fetched), (fetched, refetched)
