"""One description of a model, read once, below the engine, the trainer and the planner (issue 35 item 4).

Before, five places read a model folder each their own way and disagreed: ``hsdp generate`` loaded LTX-2's
``connectors`` (a class of ``diffusers.pipelines.ltx2``) while ``hsdp train`` refused it, and the engine read a
denoiser's patch from ``patch_size`` where the trainer read Z-Image's ``all_patch_size`` too (its size rule was 2x
looser than the pipeline's). Now :mod:`hsdp.models.description` is the one reader; these tests check that no other
module reads a pipeline's index, and that what each command's entry point asks of a model agrees, over the built-ins
and the held-out families (configs only: nothing is loaded).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hsdp.models.builtin import resolve_model
from hsdp.models.registry import BUILTIN_MODELS
from tests.heldout_pipelines import BUILDERS, build

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parents[1] / "src" / "hsdp"
WRITERS = {"models/tiny.py", "models/tiny_flux.py", "models/tiny_sdxl.py", "models/tiny_stable_audio.py",
           "models/tiny_wan.py", "models/tiny_wan_i2v.py", "models/builtin.py"}  # fmt: skip
"""The writers of the built-in models, which may name the file they write."""


def test_one_module_reads_model_folders():
    """``grep -rln "model_index.json" src/hsdp`` names the description module (and built-in writers) alone."""
    naming = {p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py") if "model_index.json" in p.read_text()}
    assert naming - WRITERS == {"models/description.py"}, naming


def test_a_pipeline_module_s_class_resolves_for_every_command(ltx2):
    """LTX-2's ``connectors`` and ``vocoder`` name ``["ltx2", ...]``: the class resolves from diffusers' pipeline
    module, as ``DiffusionPipeline.from_pretrained`` resolves it, for the loader, the trainer and the planner alike
    (``hsdp train`` said "class 'LTX2TextConnectors' is not in diffusers")."""
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    from hsdp.loading import build_component, model_class_for
    from hsdp.models.description import describe
    from hsdp.train.diffusion.frozen import meta_pipeline

    assert model_class_for(ltx2 / "connectors") is LTX2TextConnectors
    built = build_component(describe(ltx2), "connectors")
    assert type(built) is LTX2TextConnectors and all(p.is_meta for p in built.parameters())
    assert type(meta_pipeline(ltx2).connectors) is LTX2TextConnectors


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory) -> Path:
    from tests.audio_pipelines import build_tiny_ltx2

    return build_tiny_ltx2(tmp_path_factory.mktemp("ltx2") / "tiny-ltx2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, ltx2) -> dict[str, Path]:
    """Every diffusion built-in, every held-out family of the suite, and LTX-2."""
    cache = tmp_path_factory.getbasetemp() / "hsdp-cache"
    root = tmp_path_factory.mktemp("heldout")
    builtins = {name: resolve_model(name, cache_dir=cache) for name in BUILTIN_MODELS if name != "tiny-llama"}
    return builtins | {name: build(name, root) for name in BUILDERS} | {"ltx2": ltx2}


def test_generate_serve_train_and_plan_agree(folders):
    """For each model: the frame rule, the size multiple, the components and which of them are sharded, as
    ``hsdp generate`` and ``hsdp serve`` read them (:func:`hsdp.engine.model_info.inspect_model`, before any rank
    starts), as ``hsdp train`` reads them (its media sizes, denoisers, frozen encoders and the frozen components it
    shards) and as ``hsdp plan`` reads them (the components it profiles and those it counts sharded)."""
    from hsdp.engine.model_info import inspect_model
    from hsdp.planning.cli import _engine_sharded
    from hsdp.planning.profile import component_folders
    from hsdp.train.diffusion.frozen import encoder_components, frozen_sharded, media_spec
    from hsdp.train.diffusion.pipeline_call import DENOISERS

    disagree = {}
    for name, folder in folders.items():
        info = inspect_model(folder)  # generate and serve
        trained = [n for n in DENOISERS if n in info.components]
        spec = media_spec(folder, trained[0])  # train (and plan --train, which calls the same)
        plan_components = {n for n, _ in component_folders(str(folder))}
        answers = {
            "spatial": (info.spatial_multiple, spec.spatial_multiple),
            "frames": (info.temporal_factor if info.output == "video" else None,
                       spec.temporal_multiple if spec.video else None),  # fmt: skip
            "components": (set(info.components), {*encoder_components(folder), *trained, "scheduler"}),
            "denoisers": (set(info.denoisers), set(trained)),
            "sharded frozen": ([n for n in info.shardable if n not in info.denoisers], frozen_sharded(folder)),
            "sharded in plan": (info.shardable, _engine_sharded(str(folder))),
            "planned": (plan_components, plan_components & set(info.components)),
        }
        wrong = {k: v for k, v in answers.items() if v[0] != v[1]}
        if wrong:
            disagree[name] = wrong
        assert set(info.shardable) <= plan_components, name
    assert not disagree, disagree
    assert len(folders) >= len(BUILDERS) + 5


def test_size_rule_is_the_pipeline_s_for_z_image(folders):
    """Z-Image names its patch ``all_patch_size``: heights are multiples of its VAE's 8 x patch 2 = 16, which is
    what the pipeline's own check asks; the engine took patch 1 (8) and let sizes through that the pipeline
    rejected after loading."""
    from hsdp.engine.model_info import inspect_model
    from hsdp.models.description import describe

    folder = folders["z-image"]
    patch = describe(folder).config("transformer")["all_patch_size"]
    assert inspect_model(folder).spatial_multiple == 8 * int(re.sub(r"\D", "", str(patch[-1]))) == 16
