"""Training data: chat / prompt-completion / text records, label masks, packing without cross-record attention,
padding, files read through ``datasets``, eval loss; sharded runs on masked data equal one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hsdp.config import ParallelConfig
from hsdp.models.tiny import build_byte_tokenizer, build_tiny_llama
from hsdp.train import TrainConfig, Trainer
from hsdp.train.data import IGNORE, DatasetError, TokenDataset
from hsdp.train.records import read_records, tokenize_record
from hsdp.train.trainer import load_data
from tests.train_fns import train_configs

pytestmark = pytest.mark.slow

# Turns close with the eos token "</s>"; a generation prompt opens the assistant's turn.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _conversation(i: int) -> list[dict]:
    return [
        {"role": "system", "content": "answer in one word"},
        {"role": "user", "content": f"what is {i} plus one?"},
        {"role": "assistant", "content": f"{i + 1}!"},
        {"role": "user", "content": "and twice that?"},
        {"role": "assistant", "content": f"{2 * (i + 1)}."},
    ]


@pytest.fixture(scope="module")
def tokenizer():
    tok = build_byte_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def chat(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    model = root / "model"
    build_tiny_llama().save_pretrained(model)
    tokenizer.save_pretrained(model)
    data = root / "chat.jsonl"
    records = [{"messages": _conversation(i)} for i in range(40)]
    records += [{"prompt": f"spell {i}: ", "completion": " ".join(str(i))} for i in range(20)]
    records += [{"text": f"a plain note number {i} about sharded training."} for i in range(20)]
    data.write_text("\n".join(json.dumps(r) for r in records))
    return {"root": root, "model": model, "data": data}


def test_chat_labels_are_exactly_the_assistant_turns(tokenizer):
    ids, trained = tokenize_record({"messages": _conversation(4)}, tokenizer)
    eos = tokenizer.eos_token_id
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert ids == encode(tokenizer.apply_chat_template(_conversation(4), tokenize=False))
    # Each assistant turn's content and the eos that closes it; nothing of the system or user turns.
    expected = encode("5!") + [eos] + encode("10.") + [eos]
    assert [t for t, m in zip(ids, trained, strict=True) if m] == expected
    first = encode("<|system|>answer in one word</s><|user|>what is 4 plus one?</s><|assistant|>")
    assert not any(trained[: len(first)]) and all(trained[len(first) : len(first) + 3])


def test_prompt_completion_trains_the_completion_and_eos(tokenizer):
    ids, trained = tokenize_record({"prompt": "2+2=", "completion": "4"}, tokenizer)
    assert trained == [False] * 4 + [True, True] and ids[-1] == tokenizer.eos_token_id


def test_packing_keeps_attention_within_each_record():
    """Two records packed in one row: logits equal each record run alone (position ids restarting per record;
    every attention implementation: tests/test_train_packing.py)."""
    model = build_tiny_llama()
    first, second = list(range(10, 17)), list(range(40, 49))
    data = TokenDataset.pack([(first, [True] * 7), (second, [True] * 9)], seq_len=16)
    batch = data.batch_of(torch.tensor([0]))
    assert batch.attention_mask is None and batch.position_ids[0, 7].item() == 0
    assert batch.labels[0, 7].item() == IGNORE  # record 2's first token is not predicted from record 1
    with torch.no_grad():
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
        alone = [model(input_ids=torch.tensor([r])).logits for r in (first, second)]
    torch.testing.assert_close(packed.logits, torch.cat(alone, dim=1), atol=1e-5, rtol=0)


def test_padding_masks_pad_tokens(tokenizer):
    data = TokenDataset.pad([([5, 6, 7], [False, True, True]), (list(range(20)), [True] * 20)], 8, pad_id=0)
    batch = data.batch_of(torch.tensor([0, 1]))
    assert batch.attention_mask.tolist()[0] == [1, 1, 1, 0, 0, 0, 0, 0]
    assert batch.labels.tolist()[0] == [IGNORE, 6, 7] + [IGNORE] * 5 and batch.input_ids[1].tolist() == list(
        range(8)
    )


def test_parquet_and_json_read_through_datasets(tmp_path, tokenizer):
    import pandas as pd

    rows = [{"prompt": "q ", "completion": "a"}, {"prompt": "x ", "completion": "y"}]
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    (tmp_path / "d.json").write_text(json.dumps(rows))
    for name in ("d.parquet", "d.json"):
        records = read_records(tmp_path / name)
        assert [tokenize_record(r, tokenizer) for r in records] == [
            tokenize_record(r, tokenizer) for r in rows
        ]


def test_chat_without_assistant_turn_is_refused(chat, tmp_path):
    bad = tmp_path / "bad.jsonl"
    convo = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    bad.write_text(json.dumps({"messages": _conversation(1)}) + "\n" + json.dumps({"messages": convo}))
    cfg = TrainConfig(model=str(chat["model"]), data=str(bad), batch_size=1, seq_len=16)
    with pytest.raises(DatasetError) as info:
        load_data(cfg, chat["model"])
    assert "bad.jsonl:2" in str(info.value) and "no assistant turn" in str(info.value)
    assert "system, user" in str(info.value)


def test_no_packing_and_eval_loss_reported(chat):
    cfg = TrainConfig(
        model=str(chat["model"]), data=str(chat["data"]), steps=4, batch_size=4, seq_len=96, lr=1e-3,
        packing=False, eval_split=0.1, eval_every=2, progress=False,
    )  # fmt: skip
    trainer = Trainer(cfg)
    steps = trainer.fit().steps
    assert [s.eval_loss is not None for s in steps] == [False, True, False, True]
    assert steps[-1].eval_perplexity == pytest.approx(
        torch.tensor(steps[-1].eval_loss).exp().item(), rel=1e-6
    )
    assert len(trainer.eval_data) == 8 and len(trainer.data) == 72  # 10% of 80 records held out


def _masked_cfg(chat, **kw) -> TrainConfig:
    return TrainConfig(
        model=str(chat["model"]), data=str(chat["data"]), steps=3, batch_size=4, seq_len=64, lr=1e-3,
        grad_accum=2, eval_split=0.1, progress=False, **kw,
    )  # fmt: skip


def test_masked_sharded_training_and_eval_equal_one_process(dist_run, chat):
    """Rows hold different numbers of targets: the loss is normalised by the step's global target count, so
    world 2 (FULL_SHARD) equals one process, for the training losses and the eval loss."""
    single = train_configs([_masked_cfg(chat)])[0]
    fsdp = ParallelConfig(use_hsdp=True, hsdp_shard_size=2, sharding_strategy="FULL_SHARD")
    sharded = dist_run(2, train_configs, [_masked_cfg(chat, parallel=fsdp)])[0][0]
    assert sharded["losses"] == pytest.approx(single["losses"], abs=1e-5)
    assert sharded["evals"][-1] == pytest.approx(single["evals"][-1], abs=1e-5)
    worst = max((sharded["state"][k] - single["state"][k]).abs().max().item() for k in single["state"])
    assert worst <= 5e-5
