"""Training exports (``--export``, ``--export-format``, ``--export-dtype``) and the folders they write into: an export
never removes what it did not write, several formats come from one run, a sharded run writes every format one
process writes, and a re-run of a finished run exports again (issue 27 items 2, 14, 15; issue 26 item 3)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from hsdp.config import ParallelConfig
from hsdp.exports import MANIFEST
from hsdp.lora_formats import COMFYUI_WEIGHTS, DIFFUSERS_WEIGHTS, save_lora
from hsdp.train import TrainConfig, TrainConfigError, preflight
from hsdp.train.diffusion.trainer import check_diffusion_run


def _user_folder(folder):
    """A folder holding the user's own work: notes and another adapter."""
    (folder / "other-adapter").mkdir(parents=True)
    (folder / "other-adapter" / "adapter_model.safetensors").write_bytes(b"not ours")
    (folder / "notes.md").write_text("my notes")
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _contents(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _lm_with_adapter():
    from peft import LoraConfig, inject_adapter_in_model

    from hsdp.models.tiny import build_tiny_llama

    model = build_tiny_llama()
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])
    inject_adapter_in_model(config, model)
    return model, config


def test_lora_export_never_removes_what_it_did_not_write(tmp_path):
    model, config = _lm_with_adapter()
    folder = tmp_path / "mine"
    before = _user_folder(folder)
    with pytest.raises(ValueError, match="exists and is not empty"):
        save_lora(model, config, folder, run="run a")
    assert _contents(folder) == before  # nothing taken, nothing added
    out = tmp_path / "export"
    save_lora(model, config, out, run="run a")
    first = _contents(out)
    assert {"adapter_model.safetensors", "adapter_config.json", MANIFEST} <= set(first)
    save_lora(model, config, out, run="run a")  # the same run again (a restart): its own files are replaced
    assert _contents(out).keys() == first.keys()
    with pytest.raises(ValueError, match="another run"):
        save_lora(model, config, out, run="run b")
    (out / "notes.md").write_text("added by the user")
    with pytest.raises(ValueError, match=r"did not write \(notes.md\)"):
        save_lora(model, config, out, run="run a")
    assert (out / "notes.md").read_text() == "added by the user"


def test_lora_export_dtype_is_honoured(tmp_path):
    model, config = _lm_with_adapter()
    save_lora(model, config, tmp_path / "bf16", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "bf16" / "adapter_model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118


def _lm_cfg(tmp_path, **kw) -> TrainConfig:
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    base = dict(model="tiny-llama", data=str(data), steps=2, batch_size=2, seq_len=32, progress=False)
    return TrainConfig(**(base | kw))


def test_export_overlapping_the_output_dir_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    for export, output_dir in ((run, run), (run / "adapter", run), (tmp_path, run)):
        cfg = _lm_cfg(tmp_path, output_dir=str(output_dir), export=str(export))
        with pytest.raises(TrainConfigError, match="overlap"):
            preflight(cfg)
    with pytest.raises(TrainConfigError, match="overlap"):
        preflight(_lm_cfg(tmp_path, lora_r=2, export=str(run / "a"), export_merged=str(run / "a")))


def test_lm_export_folder_of_the_user_is_refused(tmp_path):
    before = _user_folder(tmp_path / "mine")
    with pytest.raises(TrainConfigError, match="not empty"):
        preflight(_lm_cfg(tmp_path, export=str(tmp_path / "mine")))
    assert _contents(tmp_path / "mine") == before


def test_lm_resume_auto_after_the_last_step_exports_again(tmp_path):
    """``--resume auto --export DIR`` run again after the run finished (a torchrun restart after the export): nothing
    left to train, the export written again; another run's command on the same folder is still refused."""
    from hsdp.train.trainer import Trainer

    cfg = _lm_cfg(tmp_path, lora_r=2, output_dir=str(tmp_path / "run"), resume="auto", export=str(tmp_path / "ad"))
    with Trainer(cfg) as trainer:
        first = trainer.fit()
    assert len(first.steps) == 2 and (tmp_path / "ad" / "adapter_model.safetensors").is_file()
    with Trainer(cfg) as trainer:
        again = trainer.fit()
    assert again.steps == [] and again.export == str(tmp_path / "ad")
    with pytest.raises(TrainConfigError, match="another run"):
        preflight(cfg.replace(output_dir=str(tmp_path / "run2")))


def _wan_cfg(media, tmp_path, **kw) -> TrainConfig:
    base = dict(model="tiny-wan", data=str(media), resolution=32, steps=1, batch_size=2, lr=1e-3, seed=3,
                lora_r=4, progress=False)  # fmt: skip
    return TrainConfig(**(base | kw))


def test_diffusion_export_refuses_a_folder_of_the_user_and_impossible_formats(media, tmp_path):
    before = _user_folder(tmp_path / "mine")
    with pytest.raises(TrainConfigError, match="not empty"):
        check_diffusion_run(_wan_cfg(media, tmp_path, export=str(tmp_path / "mine")))
    assert _contents(tmp_path / "mine") == before
    run = tmp_path / "run"
    with pytest.raises(TrainConfigError, match="overlap"):
        check_diffusion_run(_wan_cfg(media, tmp_path, output_dir=str(run), export=str(run)))
    out = str(tmp_path / "out")
    takes = "This model takes --export-format peft, diffusers"
    for model, reason in (("tiny-flux", f"{takes}, kohya$"), ("tiny-sdxl", f"UNet2DConditionModel.*{takes}, kohya$")):
        with pytest.raises(TrainConfigError, match=reason):  # before any rank starts
            check_diffusion_run(_wan_cfg(media, tmp_path, model=model, export=out, export_format="diffusers,comfyui"))
    # Wan's kohya (musubi-tuner) reader takes every linear layer of its blocks; the default targets (attention) not.
    with pytest.raises(TrainConfigError, match=f"no kohya layout.*{takes}, comfyui$"):
        check_diffusion_run(_wan_cfg(media, tmp_path, export=out, export_format="kohya"))
    blocks = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
    check_diffusion_run(_wan_cfg(media, tmp_path, export=out, export_format="kohya,comfyui", lora_target_modules=blocks))
    with pytest.raises(TrainConfigError, match="names a format twice"):
        check_diffusion_run(_wan_cfg(media, tmp_path, export=out, export_format="diffusers,diffusers"))


def _train(configs: list[TrainConfig]) -> list[tuple[int, str | None]]:
    from hsdp.train.run import train_on_rank

    return [(len(result.steps), result.export) for result in map(train_on_rank, configs)]


@pytest.mark.slow
def test_sharded_lora_exports_every_format_and_again_after_the_end(dist_run, media, tmp_path):
    """HSDP 2: the default export of a pipeline is diffusers' format, ComfyUI's is written by a sharded run too
    (its denoiser's class is FSDP2's subclass), several formats go into subfolders in ``--export-dtype``, and
    ``--resume auto`` after the last step writes them again."""
    hsdp2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
    default = _wan_cfg(media, tmp_path, parallel=hsdp2, export=str(tmp_path / "default"))
    both = default.replace(export=str(tmp_path / "both"), export_format="diffusers,comfyui", export_dtype="bf16",
                           output_dir=str(tmp_path / "run"), resume="auto")  # fmt: skip
    results = dist_run(2, _train, [default, both, both])[0]
    assert [steps for steps, _ in results] == [1, 1, 0]  # the third: nothing to train, exported again
    assert (tmp_path / "default" / DIFFUSERS_WEIGHTS).is_file()
    for fmt, name in (("diffusers", DIFFUSERS_WEIGHTS), ("comfyui", COMFYUI_WEIGHTS)):
        with safe_open(str(tmp_path / "both" / fmt / name), framework="pt") as f:
            dtypes = {f.get_tensor(k).dtype for k in f.keys()}  # noqa: SIM118
        assert dtypes == {torch.bfloat16}, (fmt, dtypes)
    manifest = json.loads((tmp_path / "both" / "comfyui" / MANIFEST).read_text())
    assert manifest["files"] == [COMFYUI_WEIGHTS]
