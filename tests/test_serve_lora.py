"""``hsdp serve`` with several LoRA adapters on one sharded base: adapters by name as ``model`` (vLLM), the
``lora`` request field (vLLM-Omni), loading and unloading at run time, metrics, and bad input.

Every output is compared with one process holding the base and only that adapter (peft, :mod:`tests.lora_refs`;
``tests/test_lora_inference.py`` shows a one-adapter server equals the same reference), or the base alone.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from hsdp.cli import main as cli_main
from hsdp.engine import SamplingParams
from hsdp.engine.model_info import inspect_model
from hsdp.engine.outputs import encode_image
from hsdp.models.tiny import build_tiny_llama
from hsdp.serve.jobs import Job
from hsdp.serve.local import LocalServer
from hsdp.serve.schemas import ApiError
from hsdp.serve.service import Server
from hsdp.serve.settings import ServeSettings
from tests.engine_refs import builtin
from tests.lora_refs import (
    WAN_BLOCK_LINEARS,
    diffusers_folder,
    diffusers_video_reference,
    kohya_files,
    lm_reference,
    save_adapter,
    video_reference,
)

pytestmark = pytest.mark.slow

HSDP2 = ["--use-hsdp", "--hsdp-shard-size", "2"]
PROMPTS = ("Adapters change", "One base, many", "Sharded weights")
MAX_TOKENS = 6


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + "{")))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return builtin("tiny-llama", tmp_path_factory.getbasetemp() / "hsdp-cache")


@pytest.fixture(scope="module")
def root(base, tmp_path_factory) -> Path:
    """``--lora-root``: adapters ``a`` (rank 4, every linear layer), ``b`` (rank 2, attention), a copy of ``a``
    to load at run time, one for another base, and a folder that is no adapter."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("lora-root")
    model = AutoModelForCausalLM.from_pretrained(base)
    save_adapter(model, folder / "a", seed=1)
    save_adapter(model, folder / "b", ["q_proj", "v_proj"], r=2, alpha=4, seed=2)
    shutil.copytree(folder / "a", folder / "late")
    save_adapter(build_tiny_llama(hidden_size=32), folder / "other")
    (folder / "empty").mkdir()
    return folder


def _text(client: httpx.Client, model: str, prompt: str) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if not Path(model).is_absolute():  # an adapter's name answers as that model (vLLM's convention)
        assert response.json()["model"] == model
    return response.json()["choices"][0]["text"]


def _expected(base: Path, adapter: Path | None, prompt: str) -> str:
    from transformers import AutoTokenizer

    tokens, _ = lm_reference(base, adapter, 1.0, prompt, MAX_TOKENS, ((1, 2),))
    return AutoTokenizer.from_pretrained(base).decode(tokens, skip_special_tokens=True)


def test_two_adapters_and_the_base_under_mixed_concurrent_requests(base, root, tmp_path):
    from transformers import AutoTokenizer

    args = [*HSDP2, "--lora", f"a={root / 'a'}", "--lora", f"b={root / 'b'}", "--lora-root", str(root)]
    models = {str(base): None, "a": root / "a", "b": root / "b"}
    requests = [(model, PROMPTS[i % 3]) for i in range(10) for model in models]  # 30, rotating adapters
    with (
        LocalServer(
            str(base), [*args, "--output-dir", str(tmp_path / "out")], log=tmp_path / "log"
        ) as server,
        httpx.Client(base_url=server.url, timeout=300) as client,
    ):
        cards = client.get("/v1/models").json()["data"]
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda r: _text(client, *r), requests))
        metrics = client.get("/metrics").text
        # Loaded at run time from under --lora-root (vLLM's route), served by name, then unloaded.
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "late"})
        late = _text(client, "late", PROMPTS[0])
        # vLLM-Omni's lora field, as on diffusion servers: adapter b at half its scale.
        by_field = client.post(
            "/v1/completions",
            json={"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "lora": {"name": "b", "scale": 0.5}},
        )
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        gone = client.post("/v1/completions", json={"model": "late", "prompt": "x", "max_tokens": 1})
        errors = {
            "outside": client.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(base)}),
            "not_lora": client.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "empty"}),
            "other_base": client.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "other"}),
        }
        final_metrics = client.get("/metrics").text
    assert [(c["id"], c["parent"]) for c in cards] == [(str(base), None), ("a", str(base)), ("b", str(base))]
    for (model, prompt), text in zip(requests, texts, strict=True):
        assert text == _expected(base, models[model], prompt), (model, prompt)
    assert len({_expected(base, models[m], PROMPTS[0]) for m in models}) == 3, "an adapter changes nothing"
    assert _metric(metrics, "hsdp_base_loads_total") == 1
    assert _metric(metrics, "hsdp_adapter_loads_total") == 2  # both fit their slots at start
    assert _metric(metrics, "hsdp_adapter_switches_total") >= 2
    assert loaded.status_code == 200 and late == _expected(base, root / "a", PROMPTS[0])
    half, _ = lm_reference(base, root / "b", 0.5, PROMPTS[1], MAX_TOKENS, ((1, 2),))
    assert by_field.status_code == 200 and by_field.json()["model"] == "b"
    assert by_field.json()["choices"][0]["text"] == AutoTokenizer.from_pretrained(base).decode(
        half, skip_special_tokens=True
    )
    assert unloaded.status_code == 200 and gone.status_code == 404
    message = gone.json()["error"]["message"]
    assert "'late' is not served" in message and "'a', 'b'" in message
    assert errors["outside"].status_code == 400 and "outside --lora-root" in errors["outside"].text
    assert errors["not_lora"].status_code == 400 and "no adapter_config.json" in errors["not_lora"].text
    other = errors["other_base"]
    assert other.status_code == 400 and "does not fit the model" in other.text and "adapter [" in other.text
    assert _metric(final_metrics, "hsdp_base_loads_total") == 1


# -- a diffusion pipeline: the vLLM-Omni ``lora`` field ------------------------------------------------------------
@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    return builtin("tiny-wan", tmp_path_factory.getbasetemp() / "hsdp-cache")


@pytest.fixture(scope="module")
def wan_root(wan, tmp_path_factory) -> Path:
    from diffusers import WanTransformer3DModel

    folder = tmp_path_factory.mktemp("wan-lora-root")
    transformer = WanTransformer3DModel.from_pretrained(str(wan / "transformer"))
    targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]
    save_adapter(transformer, folder / "x", targets, seed=3)
    save_adapter(transformer, folder / "y", targets, seed=4)
    # A ComfyUI LoRA file of every linear layer of the blocks, the feed-forward ones included, which no --lora
    # adapts (issue 33 item 9: loaded at run time all the same), and one whose keys name no layer of the model
    # (issue 26 item 4).
    kohya_files(save_adapter(transformer, folder / "k", WAN_BLOCK_LINEARS, seed=5), transformer, folder / "files")
    down, up = torch.zeros(4, 32), torch.zeros(32, 4)
    save_file({"transformer.nope.lora_A.weight": down, "transformer.nope.lora_B.weight": up}, folder / "nothing.safetensors")
    return folder


def test_lora_request_field_on_image_generations(wan, wan_root, tmp_path):
    # --max-batch-size 2: requests queued together may share an engine call only when their adapters are the same.
    args = [*HSDP2, "--lora", f"x={wan_root / 'x'}", "--lora-root", str(wan_root), "--max-loras", "2", "--max-batch-size", "2"]
    bodies = [
        {"lora": {"name": "x"}},
        {},
        {"lora": {"name": "y", "local_path": "y", "scale": 0.5}},  # loaded under its name on first use
        {"model": "x"},
        {"lora": {"name": "y", "scale": 0.5}},
        {"lora": [{"name": "x"}, {"name": "y", "scale": 0.5}]},  # composed (issue 26 item 4)
    ]
    common = {"prompt": "a red fox", "seed": 1, "num_inference_steps": 2}
    with (
        LocalServer(str(wan), [*args, "--output-dir", str(tmp_path / "out")], log=tmp_path / "log") as server,
        httpx.Client(base_url=server.url, timeout=300) as client,
    ):
        with ThreadPoolExecutor(1) as pool:  # y's first request loads it before the next names it
            responses = list(
                pool.map(lambda b: client.post("/v1/images/generations", json={**common, **b}), bodies)
            )
        # A composed request beside a single-adapter one, queued together behind a longer one: never one batch.
        busy = {"num_inference_steps": 12}
        with ThreadPoolExecutor(3) as pool:
            futures = []
            for body in (busy, *bodies[-2:]):  # in this order: the longer one runs while the others queue
                futures.append(pool.submit(client.post, "/v1/images/generations", json={**common, **body}))
                time.sleep(0.3)
            busy_response, *beside = [f.result() for f in futures]
        assert busy_response.status_code == 200, busy_response.text
        # Chat on a diffusion server resolves the adapter as the images route does, and names what served it.
        chat = {"messages": [{"role": "user", "content": "a red fox"}], "seed": 1, "num_inference_steps": 2}
        chats = {
            name: client.post("/v1/chat/completions", json={**chat, **body})
            for name, body in {
                "model": {"model": "x", "num_frames": 1},
                "lora": {"extra_body": {"lora": {"name": "x"}, "num_frames": 1}},
                "base": {"num_frames": 1},
                "composed": {"extra_body": {"lora": [{"name": "x"}, {"name": "y", "scale": 0.5}], "num_frames": 1}},
            }.items()
        }
        # A ComfyUI LoRA file loaded at run time (vLLM's route), then served by name; one binding nothing is refused.
        kohya = client.post("/v1/load_lora_adapter", json={"lora_name": "k", "lora_path": "files/comfyui.safetensors"})
        by_kohya = client.post("/v1/images/generations", json={**common, "model": "k"})
        nothing = client.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": "nothing.safetensors"})
        unknown = client.post("/v1/images/generations", json={**common, "lora": {"name": "nope"}})
        composed_unknown = client.post(
            "/v1/images/generations", json={**common, "lora": [{"name": "x"}, {"name": "nope"}]}
        )
        outside = client.post(
            "/v1/images/generations", json={**common, "lora": {"name": "z", "local_path": str(wan)}}
        )
        metrics = client.get("/metrics").text
    defaults = inspect_model(wan).defaults
    params = SamplingParams(seed=1, num_inference_steps=2, num_frames=1)
    for body, response in zip(bodies + bodies[-2:], responses + beside, strict=True):
        assert response.status_code == 200, response.text
        lora = body.get("lora") or ({"name": body["model"]} if "model" in body else None)
        if isinstance(lora, list):  # diffusers' set_adapters over its own load_lora_weights, in one process
            loras = [(diffusers_folder(wan_root / item["name"]), item.get("scale", 1.0)) for item in lora]
            frame = diffusers_video_reference(wan, loras, "a red fox", params, defaults)
        else:
            adapter = wan_root / lora["name"] if lora else None
            frame = video_reference(
                wan, adapter, lora.get("scale", 1.0) if lora else 1.0, "a red fox", params, defaults
            )
        got = base64.b64decode(response.json()["data"][0]["b64_json"])
        assert got == encode_image(frame[0], ".png"), body
    assert all(r.status_code == 200 for r in chats.values()), {k: r.text[:300] for k, r in chats.items()}
    videos = {k: r.json()["choices"][0]["message"]["content"][0]["image_url"]["url"] for k, r in chats.items()}
    assert videos["model"] == videos["lora"] != videos["base"] != videos["composed"] != videos["model"]
    assert [chats[k].json()["model"] for k in chats] == ["x", "x", str(wan), "x+y"]
    images = [r.json()["data"][0]["b64_json"] for r in responses]
    assert len({images[0], images[1], images[2], images[-1]}) == 4, "an adapter changes nothing"
    assert kohya.status_code == 200 and by_kohya.status_code == 200, (kohya.text, by_kohya.text)
    frame = diffusers_video_reference(wan, [(wan_root / "files" / "comfyui.safetensors", 1.0)], "a red fox", params, defaults)
    assert base64.b64decode(by_kohya.json()["data"][0]["b64_json"]) == encode_image(frame[0], ".png")
    message = nothing.json()["error"]["message"]
    assert nothing.status_code == 400 and "binds no layer" in message and "found base_model.model.nope.lora_A" in message
    assert unknown.status_code == 404 and "'k', 'x', 'y'" in unknown.json()["error"]["message"]
    assert composed_unknown.status_code == 404 and composed_unknown.json()["error"]["param"] == "lora.1.name"
    assert outside.status_code == 400 and "outside --lora-root" in outside.json()["error"]["message"]
    assert (
        _metric(metrics, "hsdp_base_loads_total") == 1 and _metric(metrics, "hsdp_adapter_loads_total") == 3
    )


def _video(client: httpx.Client, body: dict, timeout_s: float = 240) -> tuple[dict, bytes]:
    """An asynchronous ``/v1/videos`` job, waited for: its final record and its mp4."""
    job = client.post("/v1/videos", json=body)
    assert job.status_code == 200, job.text
    return _finished(client, job.json()["id"], timeout_s)


def _finished(client: httpx.Client, video_id: str, timeout_s: float = 240) -> tuple[dict, bytes]:
    deadline = time.monotonic() + timeout_s
    while (job := client.get(f"/v1/videos/{video_id}").json())["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    content = client.get(f"/v1/videos/{video_id}/content").content if job["status"] == "completed" else b""
    return job, content


def test_adapters_survive_engine_and_server_restarts(wan, wan_root, tmp_path):
    """Issue 27 items 6-8. A worker crash restarts the engine with the start-up adapter slots (``--lora-root``
    alone: rank 16, every linear layer), not slots re-derived from the adapters loaded since (rank 4: a rank-8
    adapter was refused); an adapter whose folder was removed is dropped with its reason logged, and the engine
    starts on the rest (it restarted for ever); a server restarted on the same output dir serves the adapters
    loaded at run time, so a queued job naming one runs, equal to the same job before (it failed: "no adapter
    named 'y'")."""
    from diffusers import WanTransformer3DModel

    root = tmp_path / "root"
    shutil.copytree(wan_root, root)
    shutil.copytree(root / "x", root / "gone")
    transformer = WanTransformer3DModel.from_pretrained(str(wan / "transformer"))
    save_adapter(transformer, root / "big", ["to_q", "to_k", "to_v", "to_out.0", "proj_out"], r=8, seed=5)
    out = tmp_path / "out"
    args = [*HSDP2, "--lora-root", str(root), "--max-loras", "2", "--output-dir", str(out)]
    body = {"prompt": "a red fox", "seed": 1, "size": "32x32", "num_frames": 1, "num_inference_steps": 2}
    with LocalServer(str(wan), args, log=tmp_path / "log") as server:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            for name in ("y", "gone"):
                loaded = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": name})
                assert loaded.status_code == 200, loaded.text
            first, with_y = _video(client, {**body, "model": "y"})
            assert first["status"] == "completed", first
            shutil.rmtree(root / "gone")
            os.kill(server.worker_pids()[1], signal.SIGKILL)
            while client.get("/health").status_code == 200:
                time.sleep(0.05)
            server.wait_healthy(timeout_s=120)
            served = [card["id"] for card in client.get("/v1/models").json()["data"]]
            big = client.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": "big"})
            gone = client.post("/v1/images/generations", json={"prompt": "x", "model": "gone"})
        assert server.stop() == 0
        log = server.log.read_text()
    assert served == [str(wan), "y"], served
    assert "no longer serving the LoRA adapter gone: adapter" in log and "no such folder" in log
    assert gone.status_code == 404
    assert big.status_code == 200, big.text
    # What a server stopped with a job still queued leaves: the job names y, loaded at run time.
    record = json.loads((out / "jobs" / f"{first['id']}.json").read_text())
    queued = Job(record["kind"], record["prompt"], record["params"], record["seed"], meta=record["meta"])
    (out / "jobs" / f"{queued.id}.json").write_text(json.dumps(queued.record()))
    with (
        LocalServer(str(wan), args, log=tmp_path / "log2") as again,
        httpx.Client(base_url=again.url, timeout=300) as client,
    ):
        served = [card["id"] for card in client.get("/v1/models").json()["data"]]
        job, content = _finished(client, queued.id)
    assert served == [str(wan), "big", "y"], served
    assert job["status"] == "completed" and content == with_y, job


# -- refused before any rank starts, or off loopback without a key --------------------------------------------
@pytest.mark.unit
def test_missing_adapter_folder_exits_before_ranks_start(base, tmp_path, capsys):
    argv = ["serve", str(base), *HSDP2, "--lora", f"a={tmp_path / 'absent'}", "--output-dir", str(tmp_path)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "--lora" in err and "no such folder" in err


@pytest.mark.unit
def test_lora_target_modules_without_lora_root_exits_before_ranks_start(base, tmp_path, capsys):
    argv = ["serve", str(base), "--lora-target-modules", "q_proj", "--output-dir", str(tmp_path)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "--lora-target-modules sizes the adapter slots" in err and "add --lora-root DIR" in err


@pytest.mark.unit
def test_loading_off_loopback_needs_an_api_key(base, root, tmp_path):
    server = Server(ServeSettings(model=str(base), host="0.0.0.0", lora_root=root, output_dir=tmp_path))
    with pytest.raises(ApiError) as info:
        server.load_adapter("late", "late", "lora_path")
    assert info.value.status == 403 and "without --api-key" in info.value.message
    keyed = Server(
        ServeSettings(model=str(base), host="0.0.0.0", api_key="k", lora_root=root, output_dir=tmp_path)
    )
    keyed.check_adapter_admin("lora_path")  # allowed with a key


@pytest.mark.unit
def test_adapters_recorded_at_run_time_are_recalled_if_still_allowed(base, root, tmp_path, caplog):
    """A restarted server takes back the adapters loaded at run time that ``--lora-root`` still covers and no
    ``--lora`` names; the others are dropped with the reason logged."""
    settings = ServeSettings(model=str(base), lora=(f"a={root / 'a'}",), lora_root=root, output_dir=tmp_path)
    Server(settings).store.save_adapters({"late": root / "late", "a": root / "b", "far": base})
    server = Server(settings)
    with caplog.at_level("WARNING", logger="hsdp"):
        server._recall_adapters()
    assert server.adapter_paths == {"a": root / "a", "late": root / "late"}
    assert "adapter a loaded before the restart: --lora now names 'a'" in caplog.text
    assert f"adapter far loaded before the restart: its folder {base} is not under --lora-root" in caplog.text
