"""Every built-in diffusers family through the engine, against the single-process diffusers pipeline: exact.

For each family, HSDP 2 and the parallel features the family supports (CFG parallel, Ulysses) give outputs exactly
equal to the unchanged pipeline in one process with the same seed and inputs; the features a family cannot use are
refused before any rank starts, naming the family and the flag. HSDP 2x2 only adds a replicate axis, which no
family's code sees: it runs for one image family here (for Wan's video in test_engine_parity.py). The reference
passes every argument explicitly, so a parameter the engine forgot or invented shows up as a difference.
"""

from __future__ import annotations

import numpy as np
import pytest

from hsdp import ParallelConfig
from hsdp.engine import Engine, SamplingParams
from hsdp.engine.checks import layout_problems
from hsdp.engine.model_info import inspect_model
from tests import engine_rank_fns
from tests.engine_refs import builtin, input_image, reference_pipeline

pytestmark = pytest.mark.slow

HSDP2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
HSDP2X2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, hsdp_replicate_size=2)
CFG2 = ParallelConfig(use_hsdp=True, cfg_parallel_size=2)
ULYSSES2 = ParallelConfig(use_hsdp=True, ulysses_degree=2)
PROMPT = "A red fox in the snow"

FLUX = {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 3.5, "max_sequence_length": 32}
WAN = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 4.0}
WAN_I2V = {**WAN, "max_sequence_length": 32}
SDXL = {"height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 5.0}
TRUE_CFG = {"true_cfg_scale": 4.0, "negative_prompt": "blurry"}

# (built-in, layout, engine params, the reference's explicit __call__ arguments)
CASES = {
    "flux-hsdp2": ("tiny-flux", HSDP2, SamplingParams(num_inference_steps=2), FLUX),
    "flux-hsdp2x2": ("tiny-flux", HSDP2X2, SamplingParams(num_inference_steps=2), FLUX),
    "flux-cfg2": ("tiny-flux", CFG2, SamplingParams(num_inference_steps=2, **TRUE_CFG), {**FLUX, **TRUE_CFG}),
    "flux-ulysses2": ("tiny-flux", ULYSSES2, SamplingParams(num_inference_steps=2), FLUX),
    "flux-kontext-hsdp2": (
        "tiny-flux-kontext",
        HSDP2,
        SamplingParams(num_inference_steps=2, image=input_image(64)),
        {**FLUX, "image": input_image(64), "max_area": 64 * 64, "_auto_resize": False},
    ),
    "flux-kontext-ulysses2": (
        "tiny-flux-kontext",
        ULYSSES2,
        SamplingParams(num_inference_steps=2, image=input_image(64)),
        {**FLUX, "image": input_image(64), "max_area": 64 * 64, "_auto_resize": False},
    ),
    "sdxl-hsdp2": ("tiny-sdxl", HSDP2, SamplingParams(num_inference_steps=2), SDXL),
    "wan-i2v-hsdp2": (
        "tiny-wan-i2v",
        HSDP2,
        SamplingParams(num_inference_steps=2, image=input_image(32)),
        {**WAN_I2V, "image": input_image(32)},
    ),
    "wan-i2v-cfg2": (
        "tiny-wan-i2v",
        CFG2,
        SamplingParams(num_inference_steps=2, image=input_image(32), negative_prompt="blurry"),
        {**WAN_I2V, "image": input_image(32), "negative_prompt": "blurry"},
    ),
    "wan-i2v-ulysses2": (
        "tiny-wan-i2v",
        ULYSSES2,
        SamplingParams(num_inference_steps=2, image=input_image(32)),
        {**WAN_I2V, "image": input_image(32)},
    ),
}


NOT_BITWISE = {"flux-ulysses2": 1e-5, "flux-kontext-ulysses2": 1e-5}
"""Layouts whose math differs in rounding only, with the bound on pixels in [0, 1] (measured: 1.3e-6). FLUX's
context-parallel plan splits the text and the image tokens, and its joint attention concatenates them per rank,
so after Ulysses' all-to-all the keys come in another order ([text0, image0, text1, image1]) and the softmax
sums round differently. Wan's plan splits only the video tokens, in order, and stays bit-exact."""


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "hsdp-cache"


@pytest.mark.parametrize("case", list(CASES))
def test_family_layout_equals_single_process(case, model_cache, dist_run):
    name, layout, params, reference_args = CASES[case]
    path = builtin(name, model_cache)
    config = layout.resolved()
    group = dist_run.group(config.world_size)
    with Engine(path, config, workers=group) as engine:
        progress: list[tuple[int, int, int]] = []
        [out] = engine.generate(
            PROMPT,
            SamplingParams(seed=5, **_fields(params)),
            on_progress=lambda *event: progress.append(event),
        )
        steps = reference_args["num_inference_steps"]
        assert progress == [(0, step, steps) for step in range(1, steps + 1)]  # live, from the step callback
        if config.cfg_parallel_size == 2:  # the branches really ran apart after the first (learning) step
            steps = group.run(engine_rank_fns.cfg_parallel_steps)
            assert all(s == [reference_args["num_inference_steps"] - 1] for s in steps), steps
    expected = reference_pipeline(path, PROMPT, 5, **reference_args)
    produced = out.frames if engine.info.output == "video" else out.images
    assert produced is not None and produced.shape == expected.shape
    assert np.isfinite(expected).all() and expected.std() > 0
    if case in NOT_BITWISE:
        np.testing.assert_allclose(produced, expected, rtol=0, atol=NOT_BITWISE[case])
        assert not np.array_equal(produced, np.zeros_like(produced))
    else:
        np.testing.assert_array_equal(produced, expected)


REQUEST_PARALLEL = {
    "tiny-flux": ({}, FLUX),
    "tiny-flux-kontext": (
        {"image": input_image(64)},
        {**FLUX, "image": input_image(64), "max_area": 64 * 64, "_auto_resize": False},
    ),
    "tiny-sdxl": ({}, SDXL),
    "tiny-wan-i2v": ({"image": input_image(32)}, {**WAN_I2V, "image": input_image(32)}),
}


@pytest.mark.parametrize("name", list(REQUEST_PARALLEL))
def test_request_parallel_each_request_equals_one_process(name, model_cache, dist_run):
    inputs, reference_args = REQUEST_PARALLEL[name]
    path = builtin(name, model_cache)
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, request_parallel=True)
    prompts = [PROMPT, "A cat playing piano"]
    with Engine(path, config, workers=dist_run.group(2)) as engine:
        outputs = engine.generate(prompts, SamplingParams(seed=5, num_inference_steps=2, **inputs))
    assert [o.rank for o in outputs] == [0, 1] and [o.seed for o in outputs] == [5, 6]
    for out in outputs:
        expected = reference_pipeline(path, out.prompt, out.seed, **reference_args)
        np.testing.assert_array_equal(out.frames if out.frames is not None else out.images, expected)


def _fields(params: SamplingParams) -> dict:
    return {k: v for k, v in vars(params).items() if v is not None and k != "seed"}


@pytest.mark.parametrize(
    "name, layout, needle",
    [
        (
            "tiny-sdxl",
            CFG2,
            "--cfg-parallel-size 2: StableDiffusionXLPipeline does not run guidance as a separate",
        ),
        (
            "tiny-sdxl",
            ULYSSES2,
            "the denoiser of StableDiffusionXLPipeline has no diffusers context-parallel plan",
        ),
        ("tiny-flux-kontext", CFG2, "FLUX.1 (FluxKontextPipeline) does not run guidance as a separate"),
    ],
)
def test_unsupported_parallel_feature_refused_before_start(name, layout, needle, model_cache):
    info = inspect_model(builtin(name, model_cache))
    assert any(needle in p for p in layout_problems(info, layout.resolved()))
    with pytest.raises(ValueError, match="cannot run this model with this layout"):
        Engine(info.path, layout)


def test_family_metadata_read_from_diffusers(model_cache):
    flux = inspect_model(builtin("tiny-flux", model_cache))
    assert (flux.output, flux.spatial_multiple, flux.cfg_scale_param) == ("image", 16, "true_cfg_scale")
    assert flux.separate_uncond_pass and flux.ulysses and flux.denoisers == ("transformer",)
    assert "transformer" in flux.shardable and "text_encoder" not in flux.shardable  # CLIP loads whole
    assert "text_encoder_2" in flux.shardable  # T5 is large beside the transformer
    sdxl = inspect_model(builtin("tiny-sdxl", model_cache))
    assert (sdxl.output, sdxl.spatial_multiple, sdxl.denoisers) == ("image", 8, ("unet",))
    assert not sdxl.separate_uncond_pass and not sdxl.ulysses
    assert sdxl.shardable == ("unet",)
    i2v = inspect_model(builtin("tiny-wan-i2v", model_cache))
    assert i2v.output == "video" and "image" in i2v.required_params and i2v.temporal_factor == 4


@pytest.mark.parametrize(
    "name, params, needle",
    [
        (
            "tiny-flux",
            SamplingParams(image=input_image(64)),
            "image: FluxPipeline takes no image (drop --image)",
        ),
        ("tiny-wan-i2v", SamplingParams(), "image: WanImageToVideoPipeline needs an input image (--image)"),
        ("tiny-flux", SamplingParams(num_frames=5), "num_frames: FluxPipeline takes no num_frames"),
        ("tiny-flux", SamplingParams(height=72), "height=72 must be a positive multiple of 16 for FLUX.1"),
        ("tiny-sdxl", SamplingParams(pipeline_kwargs={"strenght": 0.5}), "takes no strenght"),
        ("tiny-flux-kontext", SamplingParams(image=b"not an image"), "--image: a text file, not a readable image"),
    ],
)
def test_bad_inputs_refused_before_start(name, params, needle, model_cache):
    from hsdp.engine.params import build_requests

    info = inspect_model(builtin(name, model_cache))
    with pytest.raises(ValueError) as error:
        build_requests(info, HSDP2.resolved(), [PROMPT], params)
    assert needle in str(error.value)


def test_unknown_pipeline_class_is_a_clear_error(tmp_path):
    (tmp_path / "model_index.json").write_text(
        '{"_class_name": "NoSuchPipeline", "transformer": ["diffusers", "X"]}'
    )
    with pytest.raises(ValueError, match="pipeline class 'NoSuchPipeline' is not in diffusers"):
        inspect_model(tmp_path)


def test_cli_writes_images_and_image_to_video(model_cache, tmp_path, monkeypatch, capsys):
    """``hsdp generate`` end to end: the png holds exactly the pipeline's image; an input image drives i2v."""
    import imageio.v3 as iio

    from hsdp.cli import main

    monkeypatch.setenv("HSDP_CACHE", str(model_cache))
    base = ["generate", "--use-hsdp", "--hsdp-shard-size", "2", "--prompt", PROMPT, "--seed", "5"]
    assert (
        main(
            [
                *base,
                "--model",
                "tiny-flux",
                "--num-inference-steps",
                "2",
                "--output",
                str(tmp_path / "fox.png"),
            ]
        )
        == 0
    )
    expected = reference_pipeline(builtin("tiny-flux", model_cache), PROMPT, 5, **FLUX)[0]
    np.testing.assert_array_equal(iio.imread(tmp_path / "fox.png"), (np.clip(expected, 0, 1) * 255).round())
    input_image(32).save(tmp_path / "start.png")
    args = [
        "--model",
        "tiny-wan-i2v",
        "--image",
        str(tmp_path / "start.png"),
        "--output",
        str(tmp_path / "fox.mp4"),
    ]
    assert main([*base, *args, "--num-inference-steps", "2"]) == 0
    assert iio.imread(tmp_path / "fox.mp4").shape[:3] == (5, 32, 32)
    assert f"wrote {tmp_path / 'fox.mp4'}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--model", "tiny-flux", "--hsdp-shard-size", "2", "--output", "fox.mp4"],
            "this pipeline makes images, not video; name the output fox.png",
        ),
        (
            ["--model", "tiny-wan-i2v", "--hsdp-shard-size", "2"],
            "image: WanImageToVideoPipeline needs an input image (--image)",
        ),
        (
            ["--model", "tiny-sdxl", "--cfg-parallel-size", "2"],
            "StableDiffusionXLPipeline does not run guidance",
        ),
        (
            ["--model", "tiny-sdxl", "--hsdp-shard-size", "2", "--image", "nope.png"],
            "image: StableDiffusionXLPipeline takes no image",
        ),
    ],
)
def test_cli_refuses_before_starting(args, message, model_cache, monkeypatch, capsys):
    from hsdp.cli import main

    monkeypatch.setenv("HSDP_CACHE", str(model_cache))
    assert main(["generate", "--use-hsdp", "--prompt", PROMPT, *args]) == 2
    assert message in capsys.readouterr().err



def test_ltx2_sequence_parallel_is_refused_before_loading(tmp_path):
    """LTX-2 at --ulysses-degree 2 failed on the ranks after loading ("The size of tensor a (2) must match the size
    of tensor b (4)", diffusers' own context-parallel plan: the audio stream and the split rotary embedding are not
    split with the video tokens; found by the combination tier): refused before loading, naming why, for
    generation and training alike."""
    from hsdp.train import TrainConfig, TrainConfigError
    from hsdp.train.diffusion.trainer import _check_sequence_parallel
    from tests.audio_pipelines import build_tiny_ltx2

    folder = build_tiny_ltx2(tmp_path / "ltx2")
    info = inspect_model(folder)
    assert not info.ulysses and "audio stream" in info.ulysses_problem
    [problem] = [p for p in layout_problems(info, ParallelConfig(use_hsdp=True, ulysses_degree=2).resolved()) if "ulysses" in p]
    assert "--ulysses-degree/--ring-degree: the denoiser of" in problem and "audio stream" in problem
    cfg = TrainConfig(model=str(folder), data="media", parallel=ParallelConfig(use_hsdp=True, ulysses_degree=2))
    with pytest.raises(TrainConfigError, match="audio stream"):
        _check_sequence_parallel(cfg, folder, "transformer")
