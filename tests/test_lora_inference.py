"""``--lora``: a peft LoRA adapter applied to a sharded causal LM, or to a pipeline's denoiser, in
``hsdp generate`` / ``hsdp serve``.

The reference is one process with ``PeftModel.from_pretrained`` on the same base folder (weights copied into fresh
memory, one thread, as :mod:`tests.engine_refs` does for the base). The adapters' ``lora_B`` is random, not peft's
zero init, so it changes the outputs: the adapted outputs must differ from the base's, or the tests could pass with
the adapter ignored. Bad input is refused before any worker starts.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from hsdp import ParallelConfig
from hsdp.cli import main as cli_main
from hsdp.engine import Engine, SamplingParams
from hsdp.launch import worker_state
from hsdp.models.tiny import build_tiny_llama
from hsdp.serve.local import LocalServer
from tests.engine_refs import _fresh_copies, builtin, one_thread, reference_tokens, reference_video

pytestmark = pytest.mark.slow

HSDP2 = ParallelConfig(use_hsdp=True, hsdp_shard_size=2)
PROMPT = "Adapters change"
GREEDY = SamplingParams(max_new_tokens=12, temperature=0.0)
VIDEO = SamplingParams(
    seed=1, num_inference_steps=2
)  # tiny-wan's defaults otherwise (guidance 4: two passes)
IDS = torch.randint(4, 250, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return builtin("tiny-llama", tmp_path_factory.getbasetemp() / "hsdp-cache")


def _save_adapter(
    model: torch.nn.Module, folder: Path, targets: str | list[str] = "all-linear", seed: int = 0
) -> Path:
    """A peft adapter (r=4) with random ``lora_A`` and ``lora_B``, saved by peft itself."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    peft_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    return _save_adapter(
        AutoModelForCausalLM.from_pretrained(base), tmp_path_factory.mktemp("lora") / "tiny-adapter"
    )


def _peft_reference(base: Path, adapter: Path, dtype: torch.dtype) -> dict:
    """Greedy tokens and logits of one process with ``PeftModel.from_pretrained`` (which upcasts the adapters of
    a bf16 base to fp32 by default, as the engine holds them)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    _fresh_copies(model)
    model = PeftModel.from_pretrained(model, adapter).eval()
    tokenizer = AutoTokenizer.from_pretrained(base)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with one_thread(), torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=GREEDY.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        logits = model(IDS).logits
    return {"tokens": out[0, inputs["input_ids"].shape[1] :].tolist(), "logits": logits}


@pytest.fixture(scope="module")
def reference(base, adapter) -> dict:
    return _peft_reference(base, adapter, torch.float32)


def loaded_logits(ids: torch.Tensor) -> torch.Tensor:
    """Rank side: logits of the engine's loaded (sharded, adapted) model for ``ids``."""
    runner = worker_state()["hsdp.engine.runner"][0]
    with torch.no_grad():
        return runner.model(ids).logits


@pytest.mark.parametrize("dtype", [None, "bf16"])
def test_sharded_adapter_equals_peft_and_differs_from_base(base, adapter, reference, dist_run, dtype):
    """Exactly equal (measured: max |logit difference| 0.0 in fp32 and in bf16 with fp32 adapters)."""
    expected = reference if dtype is None else _peft_reference(base, adapter, torch.bfloat16)
    with Engine(base, HSDP2, workers=dist_run.group(2), lora=adapter, dtype=dtype) as engine:
        [out] = engine.generate(PROMPT, GREEDY)
        logits = dist_run(2, loaded_logits, IDS)
    assert out.token_ids == expected["tokens"]
    for rank_logits in logits:
        diff = (rank_logits - expected["logits"]).abs().max().item()
        assert torch.equal(rank_logits, expected["logits"]), f"max |logit difference| {diff:.3g}"
    assert reference["tokens"] != reference_tokens(base, PROMPT, 0, GREEDY), "the adapter changes nothing"


def test_server_serves_the_adapted_model(base, adapter, reference, tmp_path):
    from transformers import AutoTokenizer

    args = ["--use-hsdp", "--hsdp-shard-size", "2", "--lora", str(adapter)]
    with (
        LocalServer(
            str(base), [*args, "--output-dir", str(tmp_path / "out")], log=tmp_path / "log"
        ) as server,
        httpx.Client(base_url=server.url, timeout=120) as client,
    ):
        [base_card, card] = client.get("/v1/models").json()["data"]
        body = {
            "model": "tiny-adapter",
            "prompt": PROMPT,
            "max_tokens": GREEDY.max_new_tokens,
            "temperature": 0,
        }
        completion = client.post("/v1/completions", json=body)
        for_base = client.post("/v1/completions", json={**body, "model": str(base)})
    assert (card["id"], card["root"], card["parent"]) == ("tiny-adapter", str(adapter.resolve()), str(base))
    assert base_card["id"] == str(base) and base_card["parent"] is None
    assert completion.status_code == 200, completion.text
    tokenizer = AutoTokenizer.from_pretrained(base)
    want = tokenizer.decode(reference["tokens"], skip_special_tokens=True)
    assert completion.json()["choices"][0]["text"] == want
    # The base is served beside its adapters (vLLM's convention), unadapted.
    assert for_base.status_code == 200 and for_base.json()["choices"][0]["text"] != want


@pytest.fixture(scope="module")
def wan(tmp_path_factory) -> Path:
    return builtin("tiny-wan", tmp_path_factory.getbasetemp() / "hsdp-cache")


@pytest.fixture(scope="module")
def wan_adapter(wan, tmp_path_factory) -> Path:
    from diffusers import WanTransformer3DModel

    # A str path: peft writes the base's _name_or_path into the adapter's model card, and a Path breaks its YAML.
    transformer = WanTransformer3DModel.from_pretrained(str(wan / "transformer"))
    targets = ["to_q", "to_k", "to_v", "to_out.0", "proj_out"]
    return _save_adapter(transformer, tmp_path_factory.mktemp("lora") / "wan-adapter", targets)


def test_pipeline_denoiser_adapter_equals_peft(wan, wan_adapter, dist_run):
    """A peft adapter folder of the pipeline's transformer: frames exactly equal to diffusers with PeftModel."""
    from diffusers import DiffusionPipeline
    from peft import PeftModel

    with Engine(wan, HSDP2, workers=dist_run.group(2), lora=wan_adapter) as engine:
        [out] = engine.generate("a red fox", VIDEO)
    defaults = engine.info.defaults
    pipe = DiffusionPipeline.from_pretrained(wan)
    _fresh_copies(*(m for m in pipe.components.values() if isinstance(m, torch.nn.Module)))
    pipe.transformer = PeftModel.from_pretrained(pipe.transformer, wan_adapter).base_model.model.eval()
    pipe.set_progress_bar_config(disable=True)
    call = {k: getattr(VIDEO, k) if getattr(VIDEO, k) is not None else v for k, v in defaults.items()}
    with one_thread(), torch.no_grad():
        generator = torch.Generator().manual_seed(VIDEO.seed)
        expected = pipe("a red fox", generator=generator, output_type="np", **call).frames[0]
    np.testing.assert_array_equal(out.frames, expected)
    base_frames = reference_video(wan, "a red fox", VIDEO.seed, VIDEO, defaults)
    assert np.abs(expected - base_frames).max() > 0.1, "the adapter changes nothing"


# -- refused before any worker starts ----------------------------------------------------------------------------
def _refusal(capsys, argv: list[str]) -> str:
    """The refusal ``argv`` prints, without hsdp's log lines (the command's start line, when an earlier test of
    this process configured hsdp's logging)."""
    assert cli_main(argv) == 2
    return "".join(line for line in capsys.readouterr().err.splitlines(True) if not LOG_LINE.match(line))


LOG_LINE = re.compile(r"(DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d \[")
"""A line of hsdp's log format (:mod:`hsdp.logging_utils`)."""


@pytest.mark.unit
def test_missing_folder_and_folder_without_config(base, tmp_path, capsys):
    generate = ["generate", "--model", str(base), "--prompt", "x", "--use-hsdp", "--hsdp-shard-size", "2"]
    err = _refusal(capsys, [*generate, "--lora", str(tmp_path / "absent")])
    assert "--lora" in err and "no such folder" in err and "peft adapter folder" in err
    (tmp_path / "diffusers").mkdir()
    (tmp_path / "diffusers" / "pytorch_lora_weights.safetensors").write_bytes(b"")
    err = _refusal(capsys, [*generate, "--lora", str(tmp_path / "diffusers")])
    assert "--lora" in err and "pytorch_lora_weights.safetensors (diffusers' LoRA format) is not readable" in err


@pytest.mark.unit
def test_adapter_for_another_base_names_the_shapes(base, tmp_path):
    other = _save_adapter(build_tiny_llama(hidden_size=32), tmp_path / "other")
    with pytest.raises(ValueError) as info:
        Engine(base, HSDP2, lora=other)
    message = str(info.value)
    assert (
        "--lora" in message and "does not fit" in message and "adapter [" in message and "model [" in message
    )


@pytest.mark.unit
def test_adapter_of_another_kind_of_model_is_refused(wan, adapter, capsys):
    """A causal LM's adapter on a pipeline: its targets (q_proj, ...) match nothing in the denoiser."""
    err = _refusal(capsys, ["serve", str(wan), "--lora", str(adapter), "--output-dir", str(wan / "unused")])
    assert "--lora" in err and "does not fit" in err and "WanTransformer3DModel" in err and "to_q" in err


@pytest.mark.unit
def test_non_lora_adapter_and_unsupported_layouts(base, adapter, wan, wan_adapter, tmp_path):
    from hsdp.engine.checks import check_lora
    from hsdp.engine.model_info import inspect_model

    ia3 = tmp_path / "ia3"
    shutil.copytree(adapter, ia3)
    config = json.loads((ia3 / "adapter_config.json").read_text())
    (ia3 / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match="--lora .*IA3 adapter; only peft LoRA"):
        Engine(base, HSDP2, lora=ia3)
    with pytest.raises(ValueError, match="--lora with --weight-dtype int8"):
        Engine(base, HSDP2, lora=adapter, weight_dtype="int8")
    # An export of Wan 2.2's two experts (a folder per denoiser) on a pipeline with one: refused, not half applied.
    for expert in ("transformer", "transformer_2"):
        shutil.copytree(wan_adapter, tmp_path / "experts" / expert)
    with pytest.raises(ValueError, match=r"--lora \S*experts: holds an adapter of transformer_2, which WanPipeline "
                                         r"does not have \(its denoisers: transformer\)"):
        check_lora(inspect_model(wan), HSDP2.resolved(), None, tmp_path / "experts")


@pytest.mark.unit
def test_lora_files_that_bind_nothing_or_part_are_refused(wan, tmp_path, capsys):
    """Issue 26 item 4: a LoRA whose keys match no module of the model would change nothing ("trained nothing",
    verl-omni PR 553); it is refused (exit 2, before any rank starts) with the keys expected and those found. A file
    binding only some of its tensors is refused naming the unmatched ones; one with no key for the denoiser, or one
    the family's converter does not read, names what it has."""
    from safetensors.torch import save_file

    down, up = torch.zeros(4, 32), torch.zeros(32, 4)
    files = {
        "nothing": {"transformer.blocks.0.attn1.to_qq.lora_A.weight": down, "transformer.blocks.0.attn1.to_qq.lora_B.weight": up},
        "part": {
            "transformer.blocks.0.attn1.to_q.lora_A.weight": down,
            "transformer.blocks.0.attn1.to_q.lora_B.weight": up,
            "transformer.blocks.0.attn1.to_qq.lora_A.weight": down,
            "transformer.blocks.0.attn1.to_qq.lora_B.weight": up,
        },
        "encoder": {"text_encoder.x.lora_A.weight": down, "text_encoder.x.lora_B.weight": up},
        "lokr": {"transformer.blocks.0.attn1.to_q.lokr_w1": down, "transformer.blocks.0.attn1.to_q.lokr_w2": up},
        "unet": {"lora_unet_down_blocks_0_attn_to_q.lora_down.weight": down, "lora_unet_down_blocks_0_attn_to_q.alpha": torch.tensor(4.0)},
    }
    generate = ["generate", "--model", str(wan), "--prompt", "x", "--use-hsdp", "--hsdp-shard-size", "2"]
    errors = {}
    for name, tensors in files.items():
        save_file({k: v.clone() for k, v in tensors.items()}, tmp_path / f"{name}.safetensors")
        errors[name] = _refusal(capsys, [*generate, "--lora", str(tmp_path / f"{name}.safetensors")])
    assert "binds no layer of WanTransformer3DModel" in errors["nothing"]
    assert "Expected keys like base_model.model.condition_embedder" in errors["nothing"]
    assert "found base_model.model.blocks.0.attn1.to_qq.lora_A.weight" in errors["nothing"]
    assert "2 of its 4 tensors match no layer" in errors["part"] and "unexpected base_model.model.blocks.0.attn1.to_qq" in errors["part"]
    assert "none of its 2 LoRA keys" in errors["encoder"] and "found text_encoder.x.lora_A.weight" in errors["encoder"]
    assert "WanPipeline.lora_state_dict does not read this file" in errors["unet"]
    assert "no LoRA pair" in errors["lokr"] and "found blocks.0.attn1.to_q.lokr_w1" in errors["lokr"]
    assert all(e.startswith("hsdp generate: --lora ") and "Traceback" not in e for e in errors.values()), errors
    err = _refusal(capsys, [*generate, "--lora", str(tmp_path / "part.safetensors"), "--lora-scale", "1", "--lora-scale", "2"])
    assert "--lora-scale is given 2 times for 1 --lora adapters" in err
