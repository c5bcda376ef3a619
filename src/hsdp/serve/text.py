"""Causal-LM responses in OpenAI's shapes: chat prompts, stop strings, usage, and Server-Sent-Event streams.

The engine returns a request's tokens when the request ends (it has no per-token callback across processes),
so a streamed response sends its chunks once generation is done, split token by token exactly as the text
decodes. Clients that stream (the ``openai`` client with ``stream=True``) work unchanged; the first token
simply arrives with the last.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from hsdp.serve.schemas import ChatMessage

__all__ = ["TextChoice", "chat_prompt", "apply_stop", "completion_body", "chat_body", "sse_events"]


@dataclass
class TextChoice:
    index: int
    text: str
    finish_reason: str
    """``stop`` (end of sequence or a stop string) or ``length`` (max_tokens reached)."""
    token_ids: list[int]
    prompt_tokens: int


def chat_prompt(tokenizer, messages: list[ChatMessage]) -> str:
    """The tokenizer's chat template when it has one, else ``role: content`` lines and an ``assistant:`` cue."""
    turns = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"


def apply_stop(text: str, stop: str | list[str] | None) -> tuple[str, bool]:
    """Cut ``text`` before the earliest stop string; returns (text, whether one was found)."""
    stops = [stop] if isinstance(stop, str) else stop or []
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def finish_reason(new_tokens: int, max_tokens: int, stopped: bool) -> str:
    return "length" if new_tokens >= max_tokens and not stopped else "stop"


def _usage(choices: list[TextChoice]) -> dict:
    prompt = sum(c.prompt_tokens for c in choices)
    completion = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(model: str, choices: list[TextChoice]) -> dict:
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": c.index, "text": c.text, "finish_reason": c.finish_reason, "logprobs": None}
            for c in choices
        ],
        "usage": _usage(choices),
    }


def chat_body(model: str, choice: TextChoice) -> dict:
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": choice.text},
                "finish_reason": choice.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": _usage([choice]),
    }


def text_deltas(tokenizer, token_ids: list[int], final_text: str) -> Iterator[str]:
    """``final_text`` in pieces, one per token whose decoding extends it (partial UTF-8 waits for the rest)."""
    sent = 0
    for i in range(1, len(token_ids) + 1):
        partial = tokenizer.decode(token_ids[:i], skip_special_tokens=True)
        end = min(len(partial), len(final_text))
        if end <= sent or partial.endswith("\ufffd") or final_text[:end] != partial[:end]:
            continue
        yield final_text[sent:end]
        sent = end
        if sent == len(final_text):
            return
    if sent < len(final_text):
        yield final_text[sent:]


def sse_events(
    model: str, tokenizer, choices: list[TextChoice], *, chat: bool, include_usage: bool
) -> Iterator[str]:
    """OpenAI's streaming chunks as ``data: ...`` events, ending with ``data: [DONE]``."""
    prefix = "chatcmpl" if chat else "cmpl"
    base = {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
    }

    def event(choice_fields: dict | None, usage: dict | None = None) -> str:
        chunk = {**base, "choices": [choice_fields] if choice_fields else []}
        if usage is not None:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    for choice in choices:
        if chat:
            yield event(
                {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            )
        for piece in text_deltas(tokenizer, choice.token_ids, choice.text):
            if chat:
                yield event({"index": choice.index, "delta": {"content": piece}, "finish_reason": None})
            else:
                yield event({"index": choice.index, "text": piece, "finish_reason": None, "logprobs": None})
        final = {"index": choice.index, "finish_reason": choice.finish_reason}
        yield event({**final, "delta": {}} if chat else {**final, "text": "", "logprobs": None})
    if include_usage:
        yield event(None, _usage(choices))
    yield "data: [DONE]\n\n"
