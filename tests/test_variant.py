"""``--variant`` (issue 35): a component's variant weights (``diffusion_pytorch_model.bf16.safetensors``) load where
``from_pretrained(variant=...)`` loads them, the default weights otherwise; a hub download fetches only those."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hsdp.models.builtin import resolve_model
from hsdp.models.hub import pipeline_files
from hsdp.models.variant import with_variant
from hsdp.safetensors_index import CheckpointError, default_name, read_checkpoint_index, variant_of
from tests.forked_cli import run_hsdp

PROMPT, SEED = "a lighthouse", 5


@pytest.fixture(scope="module")
def wan_with_variant(tmp_path_factory):
    """tiny-wan with a ``bf16`` variant of its transformer (other weights than the default ones: a variant that
    were the same bytes would not show which file was read), written by diffusers' own ``save_pretrained``."""
    from diffusers import WanTransformer3DModel

    folder = tmp_path_factory.mktemp("variant") / "wan"
    shutil.copytree(resolve_model("tiny-wan"), folder)
    transformer = WanTransformer3DModel.from_pretrained(folder / "transformer")
    with torch.no_grad():
        for p in transformer.parameters():
            p.mul_(1.5)
    transformer.to(torch.bfloat16).save_pretrained(folder / "transformer", variant="bf16")
    return folder


def test_variant_names():
    assert variant_of("diffusion_pytorch_model.fp16.safetensors") == "fp16"
    assert variant_of("model.fp16-00001-of-00002.safetensors") == "fp16"
    assert variant_of("model.safetensors.index.fp16.json") == "fp16"
    assert variant_of("diffusion_pytorch_model.safetensors") is None
    assert variant_of("model-00001-of-00002.safetensors") is None
    assert variant_of("model.safetensors.index.json") is None
    assert default_name("model.fp16-00001-of-00002.safetensors") == "model-00001-of-00002.safetensors"
    assert default_name("model.safetensors.index.fp16.json") == "model.safetensors.index.json"


def test_a_hub_download_fetches_only_the_chosen_variant():
    files = [
        "model_index.json",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
        "unet/diffusion_pytorch_model.fp16.safetensors",
        "text_encoder/config.json",
        "text_encoder/model.safetensors.index.json",
        "text_encoder/model-00001-of-00002.safetensors",
        "text_encoder/model-00002-of-00002.safetensors",
        "text_encoder/model.safetensors.index.fp16.json",
        "text_encoder/model.fp16-00001-of-00002.safetensors",
        "text_encoder/model.fp16-00002-of-00002.safetensors",
        "vae/config.json",
        "vae/diffusion_pytorch_model.safetensors",  # no fp16 variant: the default weights
    ]
    index = {"unet": ["diffusers", "UNet2DConditionModel"], "text_encoder": ["transformers", "CLIPTextModel"],
             "vae": ["diffusers", "AutoencoderKL"]}  # fmt: skip
    default = set(pipeline_files(files, index))
    assert not any(variant_of(f.rsplit("/", 1)[-1]) for f in default)
    assert {"unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors.index.json"} <= default
    fp16 = set(pipeline_files(files, index, "fp16"))
    assert fp16 == {
        "model_index.json", "unet/config.json", "unet/diffusion_pytorch_model.fp16.safetensors",
        "text_encoder/config.json", "text_encoder/model.safetensors.index.fp16.json",
        "text_encoder/model.fp16-00001-of-00002.safetensors", "text_encoder/model.fp16-00002-of-00002.safetensors",
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
    }  # fmt: skip


def test_the_view_holds_the_variant_under_the_default_names(wan_with_variant):
    view = with_variant(wan_with_variant, "bf16")
    stored = load_file(wan_with_variant / "transformer" / "diffusion_pytorch_model.bf16.safetensors")
    index = read_checkpoint_index(view / "transformer")
    assert set(index.tensors) == set(stored) and index.floating_dtype == torch.bfloat16
    assert [p.name for p in (view / "transformer").iterdir() if p.name.endswith(".safetensors")] == [
        "diffusion_pytorch_model.safetensors"
    ]
    # Components without the variant are the model's own (linked, not copied); a second call reuses the view.
    assert (view / "vae").resolve() == (wan_with_variant / "vae").resolve()
    assert with_variant(wan_with_variant, "bf16") == view
    # The library reads it too: load_pretrained(..., variant=) (and Engine(..., variant=), which resolves the same).
    from hsdp.loading import load_pretrained

    model = load_pretrained(wan_with_variant, subfolder="transformer", variant="bf16")
    assert all(torch.equal(v, stored[k]) for k, v in model.state_dict().items() if k in stored)
    # Without --variant the default weights alone are read, never the variant beside them.
    default = read_checkpoint_index(wan_with_variant / "transformer")
    assert {e.file.name for e in default.tensors.values()} == {"diffusion_pytorch_model.safetensors"}


def test_a_missing_variant_names_what_the_folder_has(wan_with_variant, tmp_path):
    with pytest.raises(ValueError, match=r"--variant fp16: .* its variants: bf16"):
        with_variant(wan_with_variant, "fp16")
    only = tmp_path / "only-variant"
    only.mkdir()
    shutil.copy(wan_with_variant / "transformer" / "diffusion_pytorch_model.bf16.safetensors", only)
    with pytest.raises(CheckpointError, match="holds the variant.s. bf16: pass --variant bf16"):
        read_checkpoint_index(only)


def test_generate_with_a_variant_equals_diffusers_from_pretrained_with_it(wan_with_variant, tmp_path):
    """``hsdp generate --variant bf16`` at HSDP 2 against ``WanPipeline.from_pretrained(folder, variant="bf16")``
    in one process, both converting to fp32 (``--dtype fp32``; diffusers' default dtype)."""
    import imageio.v3 as iio
    from diffusers import WanPipeline

    from hsdp.engine.outputs import save_frames
    from tests.engine_refs import one_thread

    defaults = json.loads((wan_with_variant / "hsdp_defaults.json").read_text())
    done = run_hsdp(["generate", "--model", wan_with_variant, "--variant", "bf16", "--dtype", "fp32", "--prompt", PROMPT,
                     "--seed", SEED, "--use-hsdp", "--hsdp-shard-size", "2", "--output", tmp_path / "o.gif"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    pipe = WanPipeline.from_pretrained(wan_with_variant, variant="bf16", dtype=torch.float32)
    assert pipe.transformer.dtype == torch.float32
    with one_thread(), torch.no_grad():
        frames = pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), output_type="np", **defaults).frames[0]
    save_frames(frames, tmp_path / "ref.gif")
    np.testing.assert_array_equal(iio.imread(tmp_path / "o.gif"), iio.imread(tmp_path / "ref.gif"))
    default = WanPipeline.from_pretrained(wan_with_variant, dtype=torch.float32)
    with one_thread(), torch.no_grad():
        other = default(PROMPT, generator=torch.Generator().manual_seed(SEED), output_type="np", **defaults).frames[0]
    assert np.abs(other - frames).max() > 1e-3  # the variant's weights, not the default ones, made the output
