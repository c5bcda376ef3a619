"""``hsdp train`` on pipelines of families hsdp has no code for (:mod:`tests.heldout_pipelines`: diffusers' own
classes at toy sizes): the denoiser's inputs come from each pipeline's ``__call__``
(:mod:`hsdp.train.diffusion.pipeline_call`), so each family trains LoRA, and HSDP 2 equals one process training the
same objective on the same rows, noise and timesteps.

fp32; the sharded run reduces gradients in another order, so losses and adapters are compared within 1e-5 (AdamW
at lr 1e-3 over 2 steps: updates ~2e-3, rounding-level gradient differences stay below 1e-6 here). All families
train in one ``dist_run`` call (one process group, each family's trainer in turn).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hsdp.config import ParallelConfig
from hsdp.train import TrainConfig, TrainConfigError
from hsdp.train.diffusion.trainer import check_diffusion_run
from tests.diffusion_train_fns import assert_trained_like, train_diffusion
from tests.heldout_pipelines import BUILDERS, FORMULA_ONLY, build, write_square_media

pytestmark = pytest.mark.slow
TOL = 1e-5
BOTH = "transformer,transformer_2"
CASES = {name: (name, None) for name in BUILDERS} | {"wan2.2-a14b-transformer_2": ("wan2.2-a14b", "transformer_2"),
                                                    "wan2.2-a14b-both": ("wan2.2-a14b", BOTH)}  # fmt: skip
"""Case -> (held-out pipeline, trained component; None: the first denoiser), LoRA. Wan 2.2 A14B trains each expert
on its side of ``boundary_ratio``, or both in one run (in turn, one a step)."""
FULL = ("chroma", "ltx", "z-image")
"""Held-out pipelines fully fine-tuned as well: packed latents with ids (Chroma), packed video tokens in FSDP units
cut by size (LTX), lists of per-sample tensors with a reversed timestep and negated prediction (Z-Image). Not
CogVideoX: its key norms' LayerNorm bias has an exactly zero gradient (a bias on every key adds the same logit to
each), so both runs step it by AdamW's lr-sized response to rounding noise (1.6e-4 apart after 2 steps at lr 1e-3),
and a tensor whose whole gradient is rounding gives :func:`assert_trained_like` no scale to derive a bound from."""
DOCS = Path(__file__).resolve().parents[1] / "docs" / "training-diffusion.md"


@pytest.fixture(scope="module")
def heldout(tmp_path_factory) -> tuple[dict[str, Path], Path]:
    root = tmp_path_factory.mktemp("heldout")
    media = root / "media"
    media.mkdir()
    write_square_media(media)
    from tests.audio_pipelines import build_tiny_ltx2

    return {name: build(name, root) for name in BUILDERS} | {"ltx2": build_tiny_ltx2(root / "ltx2")}, media


def _cfg(folder: Path, media: Path, component: str | None, lora_r: int = 4, **kw) -> TrainConfig:
    return TrainConfig(model=str(folder), data=str(media), resolution=32, steps=2, batch_size=2, lr=1e-3, seed=3,
                       lora_r=lora_r, progress=False, train_component=component, **kw)  # fmt: skip


LTX2_TOKENS = 64
"""The tiny LTX-2's caption length (its tokenizer's ``model_max_length``), by ``--max-sequence-length``: at the
pipeline's default 1024 tokens Gemma 3 and the connectors took 78 s of a 19 s one-process run (on 2 loaded cores)."""


def _ltx2_cfg(folder: Path, media: Path, **kw) -> TrainConfig:
    return _cfg(folder, media, None, max_sequence_length=LTX2_TOKENS, **kw)


def train_toy_units(configs: list[TrainConfig]) -> list[dict]:
    """:func:`train_diffusion` on a rank, with FSDP units of 10k parameters where a denoiser names no block class
    (LTX has no ``_no_split_modules``: hsdp shards it by size, 100M parameters a unit by default, which a toy
    model never reaches)."""
    import diffusers

    for name in ("LTXVideoTransformer3DModel",):
        getattr(diffusers, name)._hsdp_min_num_params = 10_000
    return train_diffusion(configs)


@pytest.fixture(scope="module")
def sharded(heldout, dist_run, tmp_path_factory) -> dict[str, dict]:
    """Every LoRA case and the full fine-tuning of :data:`FULL` (``<name>-full``) trained at HSDP 2 (one process
    group, the cases in turn), and Wan 2.2's two experts again, run for one step (checkpointed, each expert's
    optimizer state with it) and resumed for the second."""
    folders, media = heldout
    layout = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    cfgs = [_cfg(folders[name], media, component, parallel=layout) for name, component in CASES.values()]
    cfgs += [_cfg(folders[name], media, None, lora_r=0, parallel=layout) for name in FULL]
    first = _cfg(folders["wan2.2-a14b"], media, BOTH, parallel=layout,
                 output_dir=str(tmp_path_factory.mktemp("experts-run"))).replace(steps=1)  # fmt: skip
    cfgs += [first, first.replace(steps=2, resume="auto"), _ltx2_cfg(folders["ltx2"], media, parallel=layout)]
    names = [*CASES, *(f"{name}-full" for name in FULL), "both-first", "both-resumed", "ltx2"]
    return dict(zip(names, dist_run(2, train_toy_units, cfgs, timeout_s=1500)[0], strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_heldout_family_lora_hsdp2_equals_one_process(case, heldout, sharded):
    folders, media = heldout
    name, component = CASES[case]
    one = train_diffusion([_cfg(folders[name], media, component)])[0]
    run = sharded[case]
    assert np.allclose(run["losses"], one["losses"], atol=TOL, rtol=0), (run["losses"], one["losses"])
    assert run["state"].keys() == one["state"].keys() and run["state"]
    worst = max((run["state"][k] - one["state"][k]).abs().max().item() for k in one["state"])
    assert worst < TOL, worst
    assert run["losses"][0] != run["losses"][1]  # two batches, trained weights: not a constant


def test_wan22_both_experts_equal_plain_libraries_and_resume_exactly(heldout, sharded):
    """Both experts at HSDP 2 equal one process of diffusers + peft training them in turn with an AdamW each, each
    on its side of ``boundary_ratio`` (:func:`tests.diffusion_train_fns.reference_run`): the step of one expert
    leaves the other's weights as they were. Resumed after step 1, the run equals the uninterrupted one bit for
    bit (the checkpoint holds the optimizer state of the expert not yet stepped)."""
    from tests.diffusion_train_fns import assert_trained_like, reference_run

    folders, media = heldout
    run, ref = sharded["wan2.2-a14b-both"], reference_run(_cfg(folders["wan2.2-a14b"], media, BOTH), folders["wan2.2-a14b"])
    assert {k.split(".", 1)[0] for k in run["state"]} == {"transformer", "transformer_2"}
    assert_trained_like(run, ref, TOL)
    resumed = sharded["both-resumed"]
    assert sharded["both-first"]["losses"] + resumed["losses"] == run["losses"]
    assert all(torch.equal(resumed["state"][k], run["state"][k]) for k in run["state"])


def test_train_component_is_checked_before_ranks_start(heldout):
    folders, media = heldout
    for bad in ("transformer,transformer_3", "transformer,transformer", "unet"):
        with pytest.raises(TrainConfigError, match=r"--train-component .*WanPipeline has transformer, transformer_2; "
                                                   r"name one, several comma-separated \(each once\), or all"):
            check_diffusion_run(_cfg(folders["wan2.2-a14b"], media, bad))
    with pytest.raises(TrainConfigError, match="--eval-data with --train-component all: not available"):
        check_diffusion_run(_cfg(folders["wan2.2-a14b"], media, "all", eval_data=str(media)))
    check_diffusion_run(_cfg(folders["wan2.2-a14b"], media, "all"))
    from hsdp.planning import PlanError
    from hsdp.planning.diffusion import diffusion_training

    with pytest.raises(PlanError, match="--train-component all: the planner plans one denoiser, and this run trains 2"):
        diffusion_training(str(folders["wan2.2-a14b"]), height=32, width=32, component="all")


def test_a_size_the_pipeline_refuses_in_code_is_found_before_ranks_start(heldout, tmp_path, monkeypatch, capsys):
    """LTX checks multiples of 32 in ``check_inputs``, not in anything the bucketing reads (its VAE takes multiples
    of 4 here): a 40 x 24 bucket was a traceback on every rank after loading; now ``hsdp train`` exits 2 with the
    pipeline's own message before any rank starts (issue 34)."""
    from PIL import Image

    from hsdp.cli import main
    from hsdp.train import run

    def launched(*args, **kwargs):
        raise AssertionError("ranks started")

    monkeypatch.setattr(run, "_launch", launched)
    folders, _ = heldout
    for i in range(2):
        Image.fromarray(np.zeros((40, 24, 3), np.uint8)).save(tmp_path / f"tall{i}.png")
        (tmp_path / f"tall{i}.txt").write_text("a tall picture")
    argv = ["train", "--model", str(folders["ltx"]), "--data", str(tmp_path), "--resolution", "40", "--lora-r", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the 1 x 40 x 24 size bucket (frames x height x width, 2 item(s)) is refused by LTXPipeline: `height` " \
           "and `width` have to be divisible by 32 but are 40 and 24" in err, err  # fmt: skip


@pytest.mark.parametrize("name", FULL)
def test_heldout_family_full_finetune_hsdp2_equals_one_process(name, heldout, sharded):
    """Full fine-tuning: losses within 1e-5 and every weight within what AdamW makes of rounding-level gradient
    differences (:func:`assert_trained_like`, the reference's gradients recorded in the one-process run)."""
    folders, media = heldout
    one = train_diffusion([_cfg(folders[name], media, None, lora_r=0)], grad_share=True)[0]
    run = sharded[f"{name}-full"]
    assert not any("lora_" in key for key in one["state"])
    assert sum(t.numel() for t in one["state"].values()) > 1000  # the whole denoiser, not adapters
    assert_trained_like(run, one, TOL)
    assert run["losses"][0] != run["losses"][1]


def families_table() -> str:
    """docs/training-diffusion.md's families table: what this file's and tests/test_train_loss_formulas.py's
    parametrizations prove."""
    from tests.test_train_loss_formulas import OVERFIT, SCRIPTS

    lora = {}
    for name, component in CASES.values():
        lora[name] = "yes, each expert or both" if component else "yes"
    builtin = "built-in: [correctness](#correctness)"
    rows = ["| family | LoRA, HSDP 2 = one process | full fine-tuning, HSDP 2 = one process | "
            "loss = the diffusers script's formula | overfits one sample |", "|---|---|---|---|---|"]  # fmt: skip
    for name in [*BUILDERS, *(n for n in SCRIPTS if n not in BUILDERS)]:
        cells = [
            name,
            lora.get(name, "-" if name in FORMULA_ONLY else builtin),
            "yes" if name in FULL else "-" if name in BUILDERS or name in FORMULA_ONLY else builtin,
            f"`{SCRIPTS[name][0]}`" if name in SCRIPTS else "no official script",
            "yes" if name in OVERFIT else "-",
        ]
        rows.append(f"| {' | '.join(cells)} |")
    return "\n".join(rows)


def test_docs_families_table_matches(heldout):
    """docs/training-diffusion.md has the families table the tests prove (:func:`families_table`) and each refused
    pipeline's message, as the trainer gives it."""
    text = DOCS.read_text()
    assert families_table() in text, families_table()
    folders, media = heldout
    for model in ("tiny-wan-i2v", "tiny-flux-kontext"):
        with pytest.raises(TrainConfigError, match="its __call__ takes image.*does not build yet") as refused:
            check_diffusion_run(_cfg(Path(model), media, None))
    message = str(refused.value).split(": ", 1)[1].replace("FluxKontextPipeline", "WanImageToVideoPipeline")
    assert message in text, message
    # Audio pipelines train (tests/test_train_audio.py): given images, tiny-stable-audio asks for audio files.
    with pytest.raises(TrainConfigError, match=r"no audio files found \(\.flac, \.wav\)"):
        check_diffusion_run(_cfg(Path("tiny-stable-audio"), media, None))
    assert "makes audio, which hsdp's diffusion trainer does not build yet" not in text


def test_no_import_circle_and_no_private_imports():
    """The trainer's evaluation and validation, and the frozen encoders and pipeline-call recording below them, do
    not import the trainer (which imports them); the planner imports no private name of the trainer's package."""
    import ast

    src = Path(__file__).resolve().parents[1] / "src" / "hsdp"
    below = ["evaluation", "validation", "frozen", "pipeline_call"]
    for name in below:
        tree = ast.parse((src / "train" / "diffusion" / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "hsdp.train.diffusion.trainer" not in imported, name
    for path in (src / "planning").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hsdp.train"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, (path.name, node.module, private)


def test_ltx2_lora_hsdp2_equals_one_process(heldout, sharded):
    """LTX-2 trains like the other families (issue 35 item 4): its ``connectors`` (a class of
    ``diffusers.pipelines.ltx2``, which ``hsdp train`` refused) load through the one model description and run in
    the denoiser's call with their weights; the joint transformer's audio stream gets the pipeline's own initial
    noise (a fixed seed, one row repeated: the same on every rank, step and micro-batch layout), its video
    prediction is the one trained. LoRA at HSDP 2 equals one process: losses within 1e-5 (equal here), adapters
    within what AdamW makes of rounding-level gradient differences (:func:`assert_trained_like`). The
    cross-attention queries' adapters have a gradient that cancels (3e-8 of the model's largest: the tiny model's
    text keys are alike), so AdamW steps them by rounding noise (1.4e-4 apart at 64 tokens): the bound for
    :data:`tests.diffusion_train_fns.CANCELLED` tensors. Captions at :data:`LTX2_TOKENS` tokens."""
    folders, media = heldout
    one = train_diffusion([_ltx2_cfg(folders["ltx2"], media)], grad_share=True)[0]
    run = sharded["ltx2"]
    assert any("lora_" in k for k in one["state"])
    assert_trained_like(run, one, TOL)
    assert run["losses"][0] != run["losses"][1]


def test_max_sequence_length_sets_the_caption_tokens_or_is_refused(heldout, media):
    """``--max-sequence-length`` is the pipeline's ``__call__`` argument for every pass the trainer records (issue
    34: LTX-2's default 1024 tokens made a tiny model's captions the run's cost): LTX-2's captions are encoded at
    that length, as ``LTX2Pipeline(max_sequence_length=N)`` encodes them; at the default, 1024. A pipeline whose
    ``__call__`` has no such argument (SDXL's CLIP encoders: 77 tokens) refuses it before ranks start."""
    from hsdp.train.diffusion.frozen import frozen_pipeline
    from hsdp.train.diffusion.pipeline_call import (
        call_arguments,
        encode_captions,
        prompt_layout,
        set_call_settings,
    )

    folders, square = heldout
    pipe = frozen_pipeline(folders["ltx2"])
    set_call_settings(pipe, max_sequence_length=LTX2_TOKENS)
    layout = prompt_layout(pipe, folders["ltx2"], (32, 32), 1)
    [item] = encode_captions(pipe, folders["ltx2"], layout, ["a caption"], (32, 32), 1)
    plain = pipe.encode_prompt(["a caption"], do_classifier_free_guidance=False, max_sequence_length=LTX2_TOKENS)
    assert item["prompt.0.0"].shape[0] == LTX2_TOKENS and torch.equal(item["prompt.0.0"], plain[0][0])
    set_call_settings(pipe, max_sequence_length=None)  # unset: the pipeline's own default (1024)
    assert "max_sequence_length" not in call_arguments(pipe, ["a caption"], (32, 32), 1)
    check_diffusion_run(_ltx2_cfg(folders["ltx2"], square))
    with pytest.raises(TrainConfigError, match=r"--max-sequence-length=64: StableDiffusionXLPipeline.__call__ takes "
                                               r"no max_sequence_length .*leave --max-sequence-length out"):
        check_diffusion_run(TrainConfig(model="tiny-sdxl", data=str(media), resolution=32, max_sequence_length=64))


def _samples_around_fit(cfg: TrainConfig) -> dict:
    from hsdp.train.diffusion import DiffusionTrainer

    with DiffusionTrainer(cfg) as trainer:
        first = trainer.sample()
        trainer.fit()
        return {"first": first, "last": trainer.sample()}


def test_ltx2_validation_sample_equals_generate_with_the_export(heldout, dist_run, tmp_path):
    """LTX-2's validation samples (issue 35 item 4): its ``__call__`` runs the ``connectors`` itself on the replayed
    prompt encodings, so the validation pipeline keeps their weights where the replayed text encoder stays
    weightless (before: "Tensor on device meta is not on the expected device cpu" at the first sample). The sample
    after one LoRA step equals the engine generating with the export, prompt and seed (one process; measured 0),
    and differs from the step-0 sample. The sizes come from the folder's hsdp_defaults.json, as generate's do."""
    import json
    import shutil

    from hsdp.engine import Engine, SamplingParams

    folders, media = heldout
    folder = tmp_path / "ltx2"
    shutil.copytree(folders["ltx2"], folder)
    sizes = {"height": 32, "width": 32, "num_frames": 9, "num_inference_steps": 2}
    (folder / "hsdp_defaults.json").write_text(json.dumps(sizes))
    cfg = _ltx2_cfg(folder, media).replace(steps=1, output_dir=str(tmp_path / "run"), export=str(tmp_path / "out"),
                                           validation_prompts=("a red fox",), lr=1e-2)  # fmt: skip
    run = dist_run(1, _samples_around_fit, cfg)[0]
    with Engine(folder, ParallelConfig(), workers=dist_run.group(1), lora=cfg.export) as engine:
        [out] = engine.generate("a red fox", SamplingParams(seed=cfg.seed, max_sequence_length=LTX2_TOKENS))
    [sample] = run["last"]
    assert sample.shape == out.frames.shape == (9, 32, 32, 3)
    assert abs(sample - out.frames).max() < TOL
    assert abs(sample - run["first"][0]).max() > 1e-3  # trained
    assert sorted(p.name for p in (tmp_path / "run" / "samples").iterdir()) == ["step-0", "step-1"]
