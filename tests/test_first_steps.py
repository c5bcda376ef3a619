"""The first-time frictions of issue 20, one test each: what a new user meets before the docs' commands work.

The docs tier (tests/test_docs_run.py) runs the documented commands themselves; these check the pieces behind them
fast and on their own: one model cache, the built-ins' tokenizers, messages that say what to do, the planner's
recommendation and the extras.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import tomllib

from hsdp.cli import build_parser
from hsdp.models.builtin import BUILTIN_MODELS, BUILTIN_VERSIONS, resolve_model

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]


def test_one_model_cache_for_every_entry_point(monkeypatch):
    from hsdp.models.tiny import default_cache_dir

    monkeypatch.delenv("HSDP_CACHE", raising=False)
    assert default_cache_dir() == Path.home() / ".cache" / "hsdp"
    for script in ("demo.sh", "test.sh"):  # no script of ours picks another folder than a direct hsdp run
        assert "HSDP_CACHE=" not in (ROOT / "scripts" / script).read_text()


def test_all_extra_installs_training():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "train" in extras["all"][0]


def test_generate_model_help_names_every_builtin():
    help_text = " ".join(
        build_parser()._subparsers._group_actions[0].choices["generate"].format_help().split()
    )
    help_text = help_text.replace("- ", "-")  # argparse may wrap a name at its hyphen (tiny-stable- audio)
    for name in BUILTIN_MODELS:
        assert name in help_text


def test_tiny_llama_has_a_chat_template_and_an_old_cache_folder_is_rewritten(tmp_path):
    from transformers import AutoTokenizer

    old = tmp_path / "tiny-llama"
    old.mkdir()
    (old / ".complete").touch()  # written before the chat template existed: no version in the marker
    folder = resolve_model("tiny-llama", cache_dir=tmp_path)
    assert folder == old and (folder / ".complete").read_text() == BUILTIN_VERSIONS["tiny-llama"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "2"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == "<s>user\nHi</s>\n<s>assistant\n2</s>\n"
    assert tokenizer.eos_token == "</s>"  # an assistant turn ends with EOS: a tuned model stops
    assert resolve_model("tiny-llama", cache_dir=tmp_path) == folder  # current: not written again


def test_tiny_clip_tokenizer_fits_the_docs_prompts():
    """tiny-flux used to warn "Token indices sequence length is longer than the specified maximum sequence
    length (21 > 16)" for the docs' own prompt: the byte tokenizer makes a token per character."""
    from hsdp.models.tiny_flux import CLIP_MAX_LENGTH, clip_tokenizer

    tokenizer = clip_tokenizer()
    assert tokenizer.model_max_length == CLIP_MAX_LENGTH == 77  # CLIP's own context
    prompts = [p for doc in (ROOT / "docs").glob("*.md") for p in _flux_prompts(doc.read_text())]
    assert prompts and all(len(tokenizer(p).input_ids) <= CLIP_MAX_LENGTH for p in prompts)
    assert BUILTIN_VERSIONS["tiny-flux"] and BUILTIN_VERSIONS["tiny-sdxl"]  # cached folders are rewritten


def _flux_prompts(text: str) -> list[str]:
    return [
        argv[argv.index("--prompt") + 1]
        for line in text.splitlines()
        if "--model tiny-flux" in line and "--prompt" in line
        for argv in [shlex.split(line.split("#")[0].removeprefix("$ "))]
    ]


def test_packing_too_short_says_why_and_what_to_do():
    from hsdp.models.tiny import build_byte_tokenizer
    from hsdp.train.data import DatasetError, TokenDataset
    from hsdp.train.records import tokenize_record

    tokenizer = build_byte_tokenizer()
    records = [
        {"prompt": "What is 1 plus one?", "completion": " 2"},
        {"prompt": "Hi", "completion": " there"},
    ]
    encoded = [tokenize_record(record, tokenizer) for record in records]
    dataset = TokenDataset.pack(encoded, 64, source="qa.jsonl")
    with pytest.raises(DatasetError) as refused:
        dataset.require(4)
    message = str(refused.value)
    held = sum(len(ids) for ids, _ in encoded)
    assert f"the records hold {held} tokens" in message and "full blocks of --seq-len 64" in message
    assert "--no-packing" in message and f"a --seq-len of at most {held // 4}" in message


def test_serve_names_request_fields_and_the_cli_names_flags():
    from hsdp.config import ParallelConfig
    from hsdp.engine.model_info import inspect_model
    from hsdp.engine.params import SamplingParams, build_requests

    info = inspect_model(resolve_model("tiny-wan"))
    config = ParallelConfig(use_hsdp=True, hsdp_shard_size=2).resolved()
    bad = SamplingParams(height=40, true_cfg_scale=2.0)
    with pytest.raises(ValueError) as cli:
        build_requests(info, config, ["a cat"], bad)
    assert "(--height)" in str(cli.value) and "drop --true-cfg-scale" in str(cli.value)
    with pytest.raises(ValueError) as http:
        build_requests(info, config, ["a cat"], bad, lambda name: name)
    assert "(height)" in str(http.value) and "drop true_cfg_scale" in str(http.value)
    assert "--height" not in str(http.value) and "--true-cfg-scale" not in str(http.value)


def _plan(capsys, *argv: str) -> str:
    from hsdp.cli import main

    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out


def test_plan_runs_one_request_on_one_device_and_offers_request_parallel(capsys):
    out = _plan(capsys, "tiny-sdxl", "--devices", "4", "--device-memory", "1GiB")
    assert "recommended: hsdp 4x1 " in out
    [run] = [line.removeprefix("run it: ") for line in out.splitlines() if line.startswith("run it: ")]
    assert run == "hsdp generate --model tiny-sdxl --prompt PROMPT"  # three replicas would repeat one request
    [more] = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("for throughput")]
    argv = shlex.split(more)
    assert "--request-parallel" in argv and argv.count("--prompt") == 4
    args = build_parser().parse_args(argv[1:])
    assert (args.hsdp_replicate_size, args.hsdp_shard_size, args.request_parallel) == (4, 1, True)


def test_plan_counts_components_as_the_engine_loads_them(capsys):
    """The planner reads the engine's own rule (ModelInfo.shardable): a VAE or a small encoder the engine loads
    whole is "kept whole" in the plan, a component it shards has blocks."""
    from hsdp.engine.model_info import inspect_model
    from hsdp.planning import profile_model

    for model in ("tiny-sdxl", "tiny-wan"):
        sharded = inspect_model(resolve_model(model)).shardable
        profiles = profile_model(model, sharded=sharded)
        assert {p.name for p in profiles if p.blocks} == set(sharded), model
        out = _plan(capsys, model, "--devices", "2", "--device-memory", "1GiB")
        lines = {line.split(":")[0]: line for line in out.splitlines() if ": " in line}
        for p in profiles:
            assert ("(kept whole on every rank)" in lines[p.name]) == (not p.blocks), lines[p.name]


def test_docs_tier_is_a_tier():
    markers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith("docs:") for m in markers)
    from tests.conftest import TIERS

    assert "docs" in TIERS
