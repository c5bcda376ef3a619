"""Single-file checkpoints (issue 35 item 2): a tiny Wan transformer written in the original / ComfyUI key layout
(``model.diffusion_model.blocks.0.self_attn.q.weight``...), made by inverting diffusers' own conversion and checked by
converting back with it; ``hsdp generate --transformer FILE`` at HSDP 2 equals diffusers'
``WanTransformer3DModel.from_single_file(FILE, config=...)`` in the pipeline, in one process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hsdp.models.builtin import resolve_model
from hsdp.models.single_file import with_single_files
from tests.forked_cli import run_hsdp

ROOT = Path(__file__).resolve().parents[1]
SEED, PROMPT, STEPS = 5, "a red fox", 2


def _to_original(diffusers_key: str) -> str:
    """The original Wan name of a diffusers key: diffusers' rename table applied backwards (verified below by
    converting forwards with diffusers itself)."""
    renames = [  # (original, diffusers), in the order diffusers applies them
        ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
        ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
        ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
        ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
        ("time_projection.1", "condition_embedder.time_proj"),
        ("cross_attn", "attn2"), ("self_attn", "attn1"), (".o.", ".to_out.0."), (".q.", ".to_q."),
        (".k.", ".to_k."), (".v.", ".to_v."), ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2"),
    ]  # fmt: skip
    if diffusers_key.startswith("proj_out."):
        return diffusers_key.replace("proj_out.", "head.head.")
    if diffusers_key == "scale_shift_table":
        return "head.modulation"
    key = diffusers_key.replace("scale_shift_table", "modulation")
    key = key.replace("norm2", "norm__").replace("norm3", "norm2").replace("norm__", "norm3")  # diffusers swaps them
    for original, converted in reversed(renames):
        key = key.replace(converted, original)
    return key


@pytest.fixture(scope="module")
def comfy_file(tmp_path_factory) -> Path:
    """The tiny Wan's transformer, its weights changed (so the base's own transformer would give another video), in
    the ComfyUI layout."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    base = resolve_model("tiny-wan") / "transformer" / "diffusion_pytorch_model.safetensors"
    generator = torch.Generator().manual_seed(0)
    weights = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in load_file(base).items()}
    original = {f"model.diffusion_model.{_to_original(k)}": v for k, v in weights.items()}
    assert "model.diffusion_model.blocks.0.self_attn.q.weight" in original
    back = convert_wan_transformer_to_diffusers(dict(original))
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    path = tmp_path_factory.mktemp("comfy") / "wan_tiny_t2v_comfy.safetensors"
    save_file(original, path)
    return path


def _reference(base: Path, file: Path) -> np.ndarray:
    from diffusers import WanPipeline, WanTransformer3DModel

    from tests.engine_refs import one_thread

    transformer = WanTransformer3DModel.from_single_file(str(file), config=str(base / "transformer"))
    pipe = WanPipeline.from_pretrained(base, transformer=transformer)
    for module in pipe.components.values():  # fresh memory, as the engine's (see tests/engine_refs.py)
        if isinstance(module, torch.nn.Module):
            for param in module.parameters():
                param.data = param.data.clone()
    pipe.set_progress_bar_config(disable=True)
    defaults = json.loads((base / "hsdp_defaults.json").read_text())
    call = {k: v for k, v in defaults.items() if k != "num_inference_steps"}
    with one_thread(), torch.no_grad():
        return pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), output_type="np", num_inference_steps=STEPS,
                    **call).frames[0]  # fmt: skip


def test_generate_with_a_single_file_transformer_at_hsdp2_equals_from_single_file(comfy_file, tmp_path):
    import imageio.v3 as iio

    from hsdp.engine.outputs import save_frames
    from tests.engine_refs import reference_pipeline

    base = resolve_model("tiny-wan")
    env = {**os.environ, "HSDP_CACHE": str(tmp_path / "cache")}
    argv = ["generate", "--model", str(base), "--transformer", str(comfy_file), "--prompt", PROMPT, "--seed", str(SEED),
            "--num-inference-steps", str(STEPS), "--use-hsdp", "--hsdp-shard-size", "2", "--output", str(tmp_path / "o.gif")]  # fmt: skip
    done = run_hsdp(argv, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    reference = _reference(base, comfy_file)
    defaults = {k: v for k, v in json.loads((base / "hsdp_defaults.json").read_text()).items() if k != "num_inference_steps"}
    with_base = reference_pipeline(base, PROMPT, SEED, num_inference_steps=STEPS, **defaults)
    assert np.abs(reference - with_base).max() > 1e-3  # the file's transformer makes another video than the base's
    save_frames(reference, tmp_path / "ref.gif")
    np.testing.assert_array_equal(iio.imread(tmp_path / "o.gif"), iio.imread(tmp_path / "ref.gif"))
    converted = list((tmp_path / "cache" / "single-file").glob("*/transformer/diffusion_pytorch_model.safetensors"))
    assert len(converted) == 1  # the converted component, read sharded by the ranks like any folder


def test_single_file_errors_name_the_flag(comfy_file, tmp_path, monkeypatch):
    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    wan = resolve_model("tiny-wan")
    with pytest.raises(ValueError, match="--transformer-2 .*: the pipeline in .* has no transformer_2"):
        with_single_files(wan, {"transformer_2": comfy_file})
    with pytest.raises(ValueError, match=r"--transformer replace\(s\) a component of a diffusers pipeline; .* has no model_index.json"):
        with_single_files(resolve_model("tiny-llama"), {"transformer": comfy_file})
    wrong = tmp_path / "wrong.safetensors"
    save_file({"model.diffusion_model.blocks.0.self_attn.q.weight": torch.zeros(3, 3)}, wrong)
    with pytest.raises(ValueError, match=r"--transformer .*wrong.safetensors: after diffusers' conversion for "
                                         r"WanTransformer3DModel, \d+ keys are missing"):  # fmt: skip
        with_single_files(wan, {"transformer": wrong})


def test_a_renaming_converter_never_loads_the_file(comfy_file, tmp_path, monkeypatch):
    """Wan's converter only renames: found on empty tensors, so the converted file is the same bytes under
    diffusers' names, streamed; no process loads the file's tensors (load_file would fail here)."""
    import safetensors.torch
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    real_load = safetensors.torch.load_file

    def refuse(*args, **kwargs):
        raise AssertionError("the whole single file was loaded")

    monkeypatch.setattr(safetensors.torch, "load_file", refuse)
    folder = with_single_files(resolve_model("tiny-wan"), {"transformer": comfy_file})
    monkeypatch.setattr(safetensors.torch, "load_file", real_load)
    converted = real_load(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    expected = convert_wan_transformer_to_diffusers(real_load(comfy_file))
    assert converted.keys() == expected.keys() and all(torch.equal(converted[k], expected[k]) for k in expected)
    assert (folder / "vae").resolve() == (resolve_model("tiny-wan") / "vae").resolve()  # the base's, linked


def test_wan22_experts_as_two_files_and_the_whole_file_path(comfy_file, tmp_path, monkeypatch):
    """Wan 2.2's two experts (``--transformer`` and ``--transformer-2``) each from its own file; and the path for
    converters that compute tensors (here forced: the whole file through diffusers' converter) gives the same."""
    import shutil

    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    import hsdp.models.single_file as single_file

    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "wan22"
    shutil.copytree(resolve_model("tiny-wan"), base)
    shutil.copytree(base / "transformer", base / "transformer_2")
    index = json.loads((base / "model_index.json").read_text())
    index |= {"transformer_2": index["transformer"], "boundary_ratio": 0.875}
    (base / "model_index.json").write_text(json.dumps(index))
    low = tmp_path / "low_noise.safetensors"
    save_file({k: v * 0.5 for k, v in load_file(comfy_file).items()}, low)
    monkeypatch.setattr(single_file, "_renames", lambda stored, converted: None)  # as for a computing converter
    folder = with_single_files(base, {"transformer": comfy_file, "transformer_2": low})
    for component, file in (("transformer", comfy_file), ("transformer_2", low)):
        converted = load_file(folder / component / "diffusion_pytorch_model.safetensors")
        expected = convert_wan_transformer_to_diffusers(load_file(file))
        assert converted.keys() == expected.keys() and all(torch.equal(converted[k], expected[k]) for k in expected)
    assert json.loads((folder / "model_index.json").read_text())["boundary_ratio"] == 0.875


def test_a_file_of_unknown_keys_names_the_closest_family_and_its_keys(tmp_path, monkeypatch):
    """Keys the component's converter does not know: the error names the family diffusers' own key markers point
    to (CHECKPOINT_KEY_NAMES) and a sample of the file's keys; keys of no family say so."""
    monkeypatch.setenv("HSDP_CACHE", str(tmp_path / "cache"))
    fluxish = tmp_path / "flux_dev.safetensors"
    save_file({"double_blocks.0.img_attn.norm.key_norm.scale": torch.zeros(2),
               "double_blocks.0.img_attn.qkv.weight": torch.zeros(6, 2)}, fluxish)  # fmt: skip
    for base, said in (("tiny-wan", "after diffusers' conversion for WanTransformer3DModel"),
                       ("tiny-flux", "diffusers' converter for FluxTransformer2DModel does not read its keys")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"--transformer .*flux_dev.safetensors: {said}.*marker key of 'flux' "
                                             r"\(double_blocks.0.img_attn.norm.key_norm.scale\); its keys: "
                                             r"double_blocks.0.img_attn.norm.key_norm.scale, double_blocks.0.img_attn.qkv"):  # fmt: skip
            with_single_files(resolve_model(base), {"transformer": fluxish})
    garbage = tmp_path / "garbage.safetensors"
    save_file({"foo.bar.weight": torch.zeros(2, 2)}, garbage)
    with pytest.raises(ValueError, match=r"keys match no family diffusers' single-file loaders know \(foo.bar.weight\)"):
        with_single_files(resolve_model("tiny-wan"), {"transformer": garbage})


LTX_RENAMES = (("proj_in", "patchify_proj"), ("time_embed", "adaln_single"), ("norm_q", "q_norm"), ("norm_k", "k_norm"))
"""diffusers' LTX-Video names -> the original ones: ``convert_ltx_transformer_checkpoint_to_diffusers``' renames
backwards (checked below by converting forwards with diffusers itself)."""


def test_ltx_video_single_file_at_hsdp2_equals_from_single_file(tmp_path):
    """A second family (issue 35 item 2): a held-out LTX-Video transformer (a family hsdp ships no code for) written
    in the original layout (``model.diffusion_model.patchify_proj``, ``adaln_single``, ``q_norm``...), its weights
    changed; ``hsdp generate --model BASE --transformer FILE`` at HSDP 2 equals LTXPipeline with
    ``LTXVideoTransformer3DModel.from_single_file(FILE, config=...)`` in one process, frame for frame."""
    import imageio.v3 as iio
    from diffusers import LTXPipeline, LTXVideoTransformer3DModel
    from diffusers.loaders.single_file_utils import convert_ltx_transformer_checkpoint_to_diffusers

    from hsdp.engine.outputs import save_frames
    from tests.engine_refs import one_thread
    from tests.heldout_pipelines import build

    base = build("ltx", tmp_path / "heldout")
    generator = torch.Generator().manual_seed(0)
    stored = load_file(base / "transformer" / "diffusion_pytorch_model.safetensors")
    weights = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in stored.items()}
    original = {}
    for key, value in weights.items():
        for ours, theirs in LTX_RENAMES:
            key = key.replace(ours, theirs)
        original[f"model.diffusion_model.{key}"] = value
    back = convert_ltx_transformer_checkpoint_to_diffusers(dict(original))
    assert back.keys() == weights.keys() and all(torch.equal(back[k], weights[k]) for k in weights)
    file = tmp_path / "ltx_video_tiny.safetensors"
    save_file(original, file)

    call = {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": STEPS}
    env = {**os.environ, "HSDP_CACHE": str(tmp_path / "cache")}
    argv = ["generate", "--model", str(base), "--transformer", str(file), "--prompt", PROMPT, "--seed", str(SEED),
            "--height", "32", "--width", "32", "--num-frames", "9", "--num-inference-steps", str(STEPS),
            "--use-hsdp", "--hsdp-shard-size", "2", "--output", str(tmp_path / "o.gif")]  # fmt: skip
    done = run_hsdp(argv, env=env, timeout=600)
    assert done.returncode == 0, done.stderr

    transformer = LTXVideoTransformer3DModel.from_single_file(str(file), config=str(base / "transformer"))
    pipes = [LTXPipeline.from_pretrained(base, transformer=transformer), LTXPipeline.from_pretrained(base)]
    for pipe in pipes:
        for module in pipe.components.values():  # fresh memory, as the engine's (see tests/engine_refs.py)
            if isinstance(module, torch.nn.Module):
                for param in module.parameters():
                    param.data = param.data.clone()
        pipe.set_progress_bar_config(disable=True)
    with one_thread(), torch.no_grad():
        frames, with_base = (
            pipe(PROMPT, generator=torch.Generator().manual_seed(SEED), output_type="np", **call).frames[0]
            for pipe in pipes
        )
    assert np.abs(frames - with_base).max() > 1e-3  # the file's transformer makes another video than the base's
    save_frames(frames, tmp_path / "ref.gif")
    np.testing.assert_array_equal(iio.imread(tmp_path / "o.gif"), iio.imread(tmp_path / "ref.gif"))
