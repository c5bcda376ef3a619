"""LoRA exports other tools read (:mod:`hsdp.lora_formats`): on the tiny Wan, FLUX and SDXL pipelines and the
held-out Z-Image with a peft adapter of random nonzero weights (``lora_alpha != r``), diffusers' own
``pipe.load_lora_weights`` reads the diffusers-format export and each single-file export (ComfyUI, kohya; the
layouts :mod:`hsdp.lora_layouts` derives) back into the same denoiser output as the peft adapter applied, within
1e-5, and a different one from the base; a format a family has no layout for is refused naming those it has; a
diffusers-format folder is read as a peft adapter."""

from __future__ import annotations

import pytest
import torch

from hsdp.exports import MANIFEST
from hsdp.lora import adapter_state
from hsdp.lora_formats import COMFYUI_WEIGHTS, DIFFUSERS_WEIGHTS, KOHYA_WEIGHTS, as_peft_folder, save_lora
from hsdp.models.builtin import resolve_model

pytestmark = pytest.mark.slow  # builds three pipelines and runs each four times

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]  # diffusers' training scripts' default targets
CASES = {
    # Wan also adapts a feed-forward layer (renamed in ComfyUI) and the head (outside the blocks: alpha baked in).
    "tiny-wan": ("transformer", [*ATTENTION, "ffn.net.0.proj", "proj_out"], {"height": 32, "width": 32, "num_frames": 5}),
    "tiny-flux": ("transformer", ATTENTION, {"height": 64, "width": 64, "max_sequence_length": 32}),
    "tiny-sdxl": ("unet", ATTENTION, {"height": 64, "width": 64}),
    "z-image": ("transformer", ATTENTION, {"height": 32, "width": 32}),  # held out: built by tests/heldout_pipelines
}
SINGLE_FILE = {"tiny-wan": {"comfyui"}, "tiny-flux": {"kohya"}, "tiny-sdxl": {"kohya"}, "z-image": {"comfyui", "kohya"}}
"""The single-file formats diffusers reads back for each case's adapter (the others are refused): Wan's musubi
(kohya) reader takes exactly the block linears, not the head; FLUX's and SDXL's read no ``diffusion_model.`` layout
of these names."""


def _pipeline(name: str):
    from diffusers import DiffusionPipeline

    if name == "z-image":
        from tests.heldout_pipelines import z_image

        return z_image()
    return DiffusionPipeline.from_pretrained(resolve_model(name), dtype=torch.float32)


def _run(pipe, call: dict) -> torch.Tensor:
    out = pipe(
        "a red fox", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent", **call
    )
    return next(iter(out.values()))


@torch.no_grad()
def _with_adapter(pipe, component: str, targets: list[str]):
    """Inject a peft LoRA (r 4, alpha 8) into the denoiser and fill it with seeded random nonzero weights."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    model = getattr(pipe, component)
    inject_adapter_in_model(config, model)
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    return config, model


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    name = request.param
    component, targets, call = CASES[name]
    root = tmp_path_factory.mktemp(name)
    pipe = _pipeline(name)
    base = _run(pipe, call)
    config, model = _with_adapter(pipe, component, targets)
    adapted = _run(pipe, call)
    save_lora(model, config, root / "diffusers", format="diffusers", component=component)
    single = {}
    for fmt in ("comfyui", "kohya"):
        try:
            save_lora(model, config, root / fmt, format=fmt, component=component, pipeline=type(pipe))
            single[fmt] = root / fmt
        except ValueError as exc:
            single[fmt] = str(exc)
    return {"name": name, "call": call, "base": base, "adapted": adapted, "root": root, "single": single,
            "comfy": single["comfyui"], "state": adapter_state(model), "component": component}  # fmt: skip


def _loaded(exported, folder, **kwargs) -> torch.Tensor:
    pipe = _pipeline(exported["name"])
    pipe.load_lora_weights(str(folder), **kwargs)
    return _run(pipe, exported["call"])


BUILT_IN = ["tiny-wan", "tiny-flux", "tiny-sdxl"]  # z-image joins the single-file test only (suite time)


@pytest.mark.parametrize("exported", BUILT_IN, indirect=True)
def test_diffusers_export_loads_in_diffusers_with_the_same_output(exported):
    folder = exported["root"] / "diffusers"
    # the weights and the export's manifest (hsdp.exports), which diffusers' loader leaves alone
    assert sorted(p.name for p in folder.iterdir()) == [MANIFEST, DIFFUSERS_WEIGHTS]
    out = _loaded(exported, folder)
    assert (exported["adapted"] - exported["base"]).abs().max() > 1e-3  # the adapter changes the output
    torch.testing.assert_close(out, exported["adapted"], rtol=0, atol=1e-5)


def test_single_file_exports_read_back_by_diffusers_or_refused_naming_the_formats(exported):
    """Each single-file export diffusers reads back: every module's ``scale * B @ A`` as the diffusers-format
    export's (read by the same ``lora_state_dict``), and the pipeline's output with ``load_lora_weights(file)``
    equal to the peft adapter's; a refused format names the formats the model takes."""
    from safetensors.torch import load_file

    from hsdp.lora_layouts import converted_state

    pipeline = type(_pipeline(exported["name"]))
    component = exported["component"]
    reference = {k.removeprefix("base_model.model."): v for k, v in exported["state"].items()}
    for fmt, out in exported["single"].items():
        if fmt not in SINGLE_FILE[exported["name"]]:
            assert isinstance(out, str) and "use --export-format diffusers" in out, (fmt, out)
            assert f"no {fmt} layout" in out
            continue
        assert not isinstance(out, str), out
        tensors = load_file(out / (KOHYA_WEIGHTS if fmt == "kohya" else COMFYUI_WEIGHTS))
        prefix = {"comfyui": "diffusion_model.", "kohya": "lora_"}[fmt]
        assert tensors and all(k.startswith(prefix) for k in tensors), sorted(tensors)[:3]
        back, config = converted_state(str(out / "lora.safetensors"), pipeline, component, "test")
        assert back.keys() == reference.keys()
        for key in (k for k in reference if ".lora_A." in k):
            module = key.split(".lora_A.")[0]
            b_key = key.replace(".lora_A.", ".lora_B.")
            want = (8 / 4) * reference[b_key] @ reference[key]  # the adapter's lora_alpha / r
            got = (config.lora_alpha / config.r) * back[b_key] @ back[key]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"{fmt} {module}")
        loaded = _loaded(exported, out, weight_name="lora.safetensors")
        torch.testing.assert_close(loaded, exported["adapted"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("exported", ["tiny-wan"], indirect=True)
def test_wan_comfyui_export_names_the_original_layers(exported):
    from safetensors import safe_open

    with safe_open(exported["comfy"] / COMFYUI_WEIGHTS, framework="pt") as handle:
        keys = list(handle.keys())  # noqa: SIM118
    assert "diffusion_model.blocks.0.self_attn.q.lora_down.weight" in keys
    assert "diffusion_model.head.head.lora_up.weight" in keys  # outside the blocks the reader takes no alpha


@pytest.mark.parametrize("exported", BUILT_IN, indirect=True)
def test_diffusers_folder_reads_as_a_peft_adapter(exported):
    """``--lora`` / ``--lora-adapter`` take a diffusers-format folder: the same tensors under peft keys, the same
    r, alpha and targets."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    folder = as_peft_folder(exported["root"] / "diffusers")
    assert as_peft_folder(folder) == folder  # a peft folder is taken as it is
    config = LoraConfig.from_pretrained(folder)
    assert (config.r, config.lora_alpha) == (4, 8)
    stored = load_file(folder / "adapter_model.safetensors")
    assert stored.keys() == exported["state"].keys()
    for key, tensor in exported["state"].items():
        assert torch.equal(stored[key], tensor), key


def test_lm_refuses_diffusers_formats(tmp_path):
    from peft import LoraConfig, inject_adapter_in_model

    from hsdp.models.tiny import build_tiny_llama

    model = build_tiny_llama()
    config = LoraConfig(r=2, target_modules=["q_proj"])
    inject_adapter_in_model(config, model)
    with pytest.raises(ValueError, match="--export-format peft"):
        save_lora(model, config, tmp_path / "x", format="diffusers")
    with pytest.raises(ValueError, match="use one of peft, diffusers, comfyui, kohya"):
        save_lora(model, config, tmp_path / "x", format="onetrainer")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("exported", ["tiny-wan"], indirect=True)
def test_generate_lora_takes_a_diffusers_folder(exported, dist_run):
    """``hsdp generate --lora`` with the diffusers-format export, sharded over 2 ranks: the frames of diffusers'
    pipeline with ``load_lora_weights`` of the same folder."""
    import numpy as np

    from hsdp import ParallelConfig
    from hsdp.engine import Engine, SamplingParams
    from tests.engine_refs import _fresh_copies, one_thread

    folder, video = exported["root"] / "diffusers", SamplingParams(seed=1, num_inference_steps=2)
    hsdp2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    with Engine(resolve_model("tiny-wan"), hsdp2, workers=dist_run.group(2), lora=folder) as engine:
        [out] = engine.generate("a red fox", video)
    pipe = _pipeline("tiny-wan")
    _fresh_copies(*(m for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
    pipe.load_lora_weights(str(folder))
    pipe.set_progress_bar_config(disable=True)
    call = {k: getattr(video, k) if getattr(video, k) is not None else v for k, v in engine.info.defaults.items()}
    with one_thread(), torch.no_grad():
        expected = pipe("a red fox", generator=torch.Generator().manual_seed(1), output_type="np", **call).frames[0]
    np.testing.assert_allclose(out.frames, expected, rtol=0, atol=1e-5)


def test_train_export_format_is_checked_before_training(tmp_path):
    from hsdp.train import TrainConfig, TrainConfigError, preflight

    data = tmp_path / "data.txt"
    data.write_text("text " * 200)
    cfg = TrainConfig(model="tiny-llama", data=str(data), lora_r=2, export=str(tmp_path / "out"))
    with pytest.raises(TrainConfigError, match="tiny-llama is not a diffusers model; use --export-format peft"):
        preflight(cfg.replace(export_format="comfyui"))
    with pytest.raises(TrainConfigError, match="without --lora-r"):
        preflight(cfg.replace(lora_r=0, export_format="diffusers"))
    with pytest.raises(TrainConfigError, match="--export-format='onetrainer'"):
        preflight(cfg.replace(export_format="onetrainer"))
    assert preflight(cfg).resume_from is None  # peft, the default for an LM


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    """Wan 2.2 A14B-shaped (the tiny Wan with a second expert below ``boundary_ratio``; its VAE, unlike
    :func:`tests.heldout_pipelines.wan22_a14b`'s, spreads the adapters' effect over many 8-bit pixel levels, which
    the served png shows) with a different random adapter in each expert, exported as ``hsdp train
    --train-component transformer,transformer_2`` writes it (one subfolder per expert, each keyed
    ``transformer.``), and ``transformer_2``'s alone as a run of that expert writes it."""
    from diffusers import WanPipeline

    from hsdp.models.tiny_wan import build_tiny_wan_pipeline

    root = tmp_path_factory.mktemp("wan22")
    folder = root / "wan2.2-a14b"
    build_tiny_wan_pipeline(boundary_ratio=0.875).save_pretrained(folder)
    pipe = WanPipeline.from_pretrained(folder, dtype=torch.float32)
    call = {"height": 32, "width": 32, "num_frames": 5}
    base = _run(pipe, call)
    config, high = _with_adapter(pipe, "transformer", ATTENTION)
    with torch.no_grad():  # another draw for the low-noise expert
        _, low = _with_adapter(pipe, "transformer_2", ATTENTION)
        for name, param in low.named_parameters():
            if ".lora_" in name:
                param.mul_(-1.5)
    adapted = _run(pipe, call)
    save_lora({"transformer": high, "transformer_2": low}, config, root / "both", format="diffusers",
              component="transformer")  # fmt: skip
    save_lora({"transformer_2": low}, config, root / "low", format="diffusers", component="transformer")
    return {"folder": folder, "root": root, "call": call, "base": base, "adapted": adapted}


def _wan22(experts, *loads: tuple[str, dict]):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(experts["folder"], dtype=torch.float32)
    for sub, kwargs in loads:
        pipe.load_lora_weights(str(experts["root"] / sub), **kwargs)
    return pipe


def test_two_expert_export_loads_into_both_transformers(experts):
    """The pair as diffusers loads it: the high-noise adapter with ``load_lora_weights(folder/transformer)``, the
    low-noise one with ``load_lora_weights(folder/transformer_2, load_into_transformer_2=True)``: the output of
    both adapters applied with peft."""
    assert sorted(p.name for p in (experts["root"] / "both").iterdir()) == [MANIFEST, "transformer", "transformer_2"]
    pipe = _wan22(experts, ("both/transformer", {}), ("both/transformer_2", {"load_into_transformer_2": True}))
    assert (experts["adapted"] - experts["base"]).abs().max() > 1e-3
    torch.testing.assert_close(_run(pipe, experts["call"]), experts["adapted"], rtol=0, atol=1e-5)


EXPERT_LOADS = {
    "both": [("both/transformer", {}), ("both/transformer_2", {"load_into_transformer_2": True})],
    "low": [("low/transformer_2", {"load_into_transformer_2": True})],
    "base": [],
}
"""Adapter -> the ``load_lora_weights`` calls that load its export into plain diffusers."""


@pytest.fixture(scope="module")
def expert_frames(experts) -> tuple[dict, dict]:
    """The sampling arguments of one 32 x 32 frame in 2 steps, seed 1 (as the engine completes them from the
    pipeline's defaults), and the frames of plain diffusers with each of :data:`EXPERT_LOADS` loaded, in one
    process."""
    from hsdp.engine import SamplingParams
    from hsdp.engine.model_info import inspect_model
    from tests.engine_refs import one_thread

    params = SamplingParams(seed=1, num_inference_steps=2, height=32, width=32, num_frames=1)
    defaults = inspect_model(experts["folder"]).defaults
    call = {k: getattr(params, k) if getattr(params, k) is not None else v for k, v in defaults.items()}
    frames = {}
    for name, loads in EXPERT_LOADS.items():
        pipe = _wan22(experts, *loads)
        pipe.set_progress_bar_config(disable=True)
        with one_thread(), torch.no_grad():
            frames[name] = pipe("a red fox", generator=torch.Generator().manual_seed(1), output_type="np", **call).frames[0]
    assert all(abs(frames[a] - frames[b]).max() > 1e-3 for a, b in (("both", "low"), ("low", "base")))
    return params, frames


def test_generate_lora_applies_both_experts(experts, expert_frames, dist_run):
    """``hsdp generate --lora`` at HSDP 2 with the two-expert export equals diffusers with both halves loaded, and
    a ``transformer_2``-only export equals diffusers with it loaded into ``transformer_2`` alone (and differs from
    the pair and from the base)."""
    import numpy as np

    from hsdp import ParallelConfig
    from hsdp.engine import Engine

    params, frames = expert_frames
    hsdp2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    with Engine(experts["folder"], hsdp2, workers=dist_run.group(2),
                lora={"both": experts["root"] / "both", "low": experts["root"] / "low"}) as engine:  # fmt: skip
        for name in EXPERT_LOADS:  # base: every slot off
            out = engine.generate("a red fox", params, adapter=None if name == "base" else name)[0].frames
            np.testing.assert_allclose(out, frames[name], rtol=0, atol=1e-5, err_msg=name)


def test_serve_lora_applies_both_experts(experts, expert_frames, tmp_path):
    """Issue 26 item 2's round trip ends in ``hsdp serve --lora``: at HSDP 2 the two-expert export given at start,
    the ``transformer_2``-only export loaded at run time (``/v1/load_lora_adapter``) and the base, each requested
    by name, equal plain diffusers with the same exports loaded (:data:`EXPERT_LOADS`). The served png holds 8-bit
    pixels: each equals the reference's pixel, except by one level where the reference lies within the engine's
    1e-5 (:func:`test_generate_lora_applies_both_experts`) of a rounding boundary."""
    import base64
    import io

    import httpx
    import numpy as np
    from PIL import Image

    from hsdp.serve.local import LocalServer

    params, frames = expert_frames
    root = experts["root"]
    args = ["--use-hsdp", "--hsdp-shard-size", "2", "--lora", f"both={root / 'both'}", "--lora-root", str(root),
            "--max-loras", "2", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    # The images route makes one frame, as the reference's num_frames=1.
    body = {"prompt": "a red fox", "seed": params.seed, "num_inference_steps": params.num_inference_steps,
            "size": f"{params.width}x{params.height}"}  # fmt: skip
    with (
        LocalServer(str(experts["folder"]), args, log=tmp_path / "log") as server,
        httpx.Client(base_url=server.url, timeout=300) as client,
    ):
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "low", "lora_path": "low"})
        assert loaded.status_code == 200, loaded.text
        served = {
            name: client.post("/v1/images/generations", json={**body, **({} if name == "base" else {"model": name})})
            for name in EXPERT_LOADS
        }
    pixels = {}
    for name, response in served.items():
        assert response.status_code == 200, response.text
        got = pixels[name] = np.asarray(Image.open(io.BytesIO(base64.b64decode(response.json()["data"][0]["b64_json"]))), int)
        scaled = np.clip(frames[name][0], 0, 1) * 255
        off = np.abs(got - scaled.round())
        near_boundary = np.abs(scaled - np.floor(scaled) - 0.5) < 255 * 1e-5
        assert off.max() <= 1 and (near_boundary | (off == 0)).all(), (name, off.max(), (off > 0).sum())
    for a, b in (("both", "low"), ("low", "base"), ("both", "base")):  # each adapter shows in the pixels
        assert (np.abs(pixels[a] - pixels[b]) > 1).mean() > 0.5, (a, b)
