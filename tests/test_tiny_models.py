"""The built-in tiny diffusers pipelines (FLUX, FLUX Kontext, SDXL, Wan2.1 I2V): written into a cache, loaded back
with ``DiffusionPipeline.from_pretrained`` (offline) and run at their ``hsdp_defaults.json`` on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp.generation_defaults import DEFAULTS_FILE
from hsdp.models.builtin import BUILTIN_MODELS, resolve_model

pytestmark = pytest.mark.slow

MODELS = {
    # name: (pipeline class, the denoiser component, output shape at the defaults, takes an input image)
    "tiny-flux": ("FluxPipeline", "transformer", (1, 64, 64, 3), False),
    "tiny-flux-kontext": ("FluxKontextPipeline", "transformer", (1, 64, 64, 3), True),
    "tiny-sdxl": ("StableDiffusionXLPipeline", "unet", (1, 64, 64, 3), False),
    "tiny-wan-i2v": ("WanImageToVideoPipeline", "transformer", (1, 5, 32, 32, 3), True),
}


def _image(seed: int, size: int = 64):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hsdp-cache")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Each call is tens of milliseconds on one thread; more threads only add contention on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    _PIPELINES.clear()


_PIPELINES: dict = {}


def _load(name: str, cache):
    if name == "tiny-wan-i2v":
        # diffusers' WanImageToVideoPipeline cleans prompts with ftfy without checking that it is installed.
        pytest.importorskip("ftfy", reason="WanImageToVideoPipeline needs ftfy (pip install ftfy)")
    if name not in _PIPELINES:
        from diffusers import DiffusionPipeline

        folder = resolve_model(name, cache_dir=cache)
        pipe = DiffusionPipeline.from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        defaults = json.loads((folder / DEFAULTS_FILE).read_text())
        _PIPELINES[name] = (folder, pipe, defaults)
    return _PIPELINES[name]


def _run(name: str, cache, *, seed: int = 0, image_seed: int = 0, **overrides) -> np.ndarray:
    _, pipe, defaults = _load(name, cache)
    kwargs = {**defaults, **overrides}
    if MODELS[name][3]:
        kwargs["image"] = _image(image_seed)
    out = pipe(
        prompt="a tiny red fox", generator=torch.Generator().manual_seed(seed), output_type="np", **kwargs
    )
    return np.asarray(out.frames if hasattr(out, "frames") else out.images)


@pytest.mark.parametrize("name", list(MODELS))
def test_builtin_saved_as_diffusers_folder(name, cache):
    assert name in BUILTIN_MODELS
    folder, pipe, defaults = _load(name, cache)
    cls, denoiser, _, _ = MODELS[name]
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == cls
    assert type(pipe).__name__ == cls
    assert list((folder / denoiser).glob("*.safetensors"))
    assert {"height", "width", "num_inference_steps", "guidance_scale"} <= set(defaults)
    # hsdp shards the denoiser block by block; diffusers names the blocks in _no_split_modules.
    assert getattr(pipe, denoiser)._no_split_modules
    sizes = {
        key: sum(p.numel() for p in module.parameters())
        for key, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
    }
    assert sum(sizes.values()) < 1_500_000, sizes
    if name.startswith("tiny-flux"):
        # The engine shards large text encoders and keeps small ones whole, by size relative to the transformer.
        assert sizes["text_encoder_2"] >= 0.3 * sizes["transformer"], sizes
        assert sizes["text_encoder"] <= 0.1 * sizes["transformer"], sizes


@pytest.mark.parametrize("name", list(MODELS))
def test_builtin_generates_deterministically(name, cache):
    first = _run(name, cache, seed=0)
    assert first.shape == MODELS[name][2]
    assert np.isfinite(first).all()
    assert first.std() > 0.01
    assert np.array_equal(first, _run(name, cache, seed=0))
    assert not np.array_equal(first, _run(name, cache, seed=1))


@pytest.mark.parametrize("name", [name for name, spec in MODELS.items() if spec[3]])
def test_builtin_uses_the_input_image(name, cache):
    assert not np.array_equal(_run(name, cache, image_seed=0), _run(name, cache, image_seed=1))


def test_sdxl_guidance_changes_the_image(cache):
    # SDXL runs classifier-free guidance (batched uncond + cond) only when guidance_scale > 1.
    assert _load("tiny-sdxl", cache)[2]["guidance_scale"] > 1
    assert not np.array_equal(_run("tiny-sdxl", cache), _run("tiny-sdxl", cache, guidance_scale=1.0))


def test_builtin_written_by_a_rank_other_than_0_is_whole(dist_run, tmp_path):
    """transformers saves weights only on global rank 0 of a process group: a built-in first needed on rank 1
    must still get its weights (a pipeline's text encoders lost theirs, and the folder was marked complete)."""
    from safetensors.torch import load_file

    from tests.core_fns import resolve_builtin_on_rank

    folder = dist_run(2, resolve_builtin_on_rank, 1, "tiny-llama", str(tmp_path / "ranks"))[1]
    written = load_file(Path(folder) / "model.safetensors")
    reference = load_file(resolve_model("tiny-llama", cache_dir=tmp_path / "here") / "model.safetensors")
    assert written.keys() == reference.keys() and written
    assert all(torch.equal(written[k], reference[k]) for k in reference)
