"""Causal-LM responses in OpenAI's shapes: chat prompts, stop strings, usage, and Server-Sent-Event streams.

Streams are live: the engine hands each token over as the sharded ranks produce it (rank 0 publishes), and
:class:`TextStream` turns the growing token list into text pieces, holding back what could still become a stop
string or an incomplete UTF-8 character, so the concatenated pieces equal the non-streamed answer.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from hsdp.serve.schemas import ChatMessage

__all__ = [
    "TextChoice",
    "TextStream",
    "SseChunks",
    "chat_prompt",
    "apply_stop",
    "finish_reason",
    "completion_body",
    "chat_body",
    "chat_completion",
]


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


def chat_completion(model: str, content: str | list[dict] | None, finish_reason: str, usage: dict) -> dict:
    """OpenAI's ``chat.completion`` object with one assistant message (text, or content parts)."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage,
    }


def chat_body(model: str, choice: TextChoice) -> dict:
    return chat_completion(model, choice.text, choice.finish_reason, _usage([choice]))


class TextStream:
    """Text pieces of one choice as its tokens arrive; a stop string ends it (the piece stops before it)."""

    def __init__(self, tokenizer, stop: str | list[str] | None):
        self.tokenizer = tokenizer
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = 0
        self.stopped = False

    def update(self, token_ids: list[int], *, final: bool) -> str:
        """The next piece for ``token_ids`` so far; ``final`` flushes what was held back."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        cut, self.stopped = apply_stop(text, self.stops)
        # Hold back a partial character, or what may be the beginning of a stop string.
        end = len(cut) if self.stopped or final else len(text.rstrip("\ufffd")) - self.hold
        if end <= self.sent:
            return ""
        piece, self.sent = cut[self.sent : end], end
        return piece


class SseChunks:
    """OpenAI's streaming chunks (``data: ...`` events) of one response."""

    def __init__(self, model: str, *, chat: bool):
        self.chat = chat
        self.base = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def _event(self, choice_fields: dict | None, usage: dict | None = None) -> str:
        chunk = {**self.base, "choices": [choice_fields] if choice_fields else []}
        if usage is not None:
            chunk["usage"] = usage
        return f"data: {json.dumps(chunk)}\n\n"

    def start(self, index: int) -> str | None:
        """Chat opens each choice with the assistant role."""
        if not self.chat:
            return None
        return self._event(
            {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        )

    def piece(self, index: int, text: str) -> str:
        if self.chat:
            return self._event({"index": index, "delta": {"content": text}, "finish_reason": None})
        return self._event({"index": index, "text": text, "finish_reason": None, "logprobs": None})

    def finish(self, index: int, reason: str) -> str:
        final = {"index": index, "finish_reason": reason}
        return self._event({**final, "delta": {}} if self.chat else {**final, "text": "", "logprobs": None})

    def usage(self, choices: list[TextChoice]) -> str:
        return self._event(None, _usage(choices))

    @staticmethod
    def error(error: dict) -> str:
        return f"data: {json.dumps({'error': {**error, 'type': 'server_error'}})}\n\n"

    @staticmethod
    def done() -> str:
        return "data: [DONE]\n\n"
