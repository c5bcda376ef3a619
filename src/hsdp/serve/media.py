"""Images in and out of the diffusion endpoints: uploads, data URLs, and chat completions that generate media.

vLLM-Omni generates images through ``POST /v1/chat/completions`` on a diffusion model: the prompt is the text of
the user messages, input images are ``image_url`` parts holding data URLs, the generation parameters come in
``extra_body`` (nested in raw JSON, or flattened to the top level by the ``openai`` client, which merges
``extra_body`` into the body), and the answer's ``message.content`` is a list of ``image_url`` parts with data URLs.
"""

from __future__ import annotations

import base64
import binascii
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from hsdp.serve.http import describe_validation_errors
from hsdp.serve.schemas import ApiError, ChatCompletionRequest, ChatImageParams
from hsdp.serve.text import chat_completion

__all__ = [
    "Upload",
    "MIME_TYPES",
    "data_url",
    "decode_data_url",
    "reference_upload",
    "chat_generation",
    "chat_media_body",
    "chat_audio_body",
]

MIME_TYPES = {
    "png": "image/png",
    "jpeg": "image/jpeg",
    "jpg": "image/jpeg",
    "webp": "image/webp",
    "mp4": "video/mp4",
    "wav": "audio/wav",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "pcm": "audio/pcm",
}


@dataclass(frozen=True)
class Upload:
    """An input image as the client sent it: its field name (for errors), the pipeline argument, the bytes."""

    field: str
    engine_field: str
    data: bytes


def data_url(data: bytes, fmt: str) -> str:
    return f"data:{MIME_TYPES[fmt]};base64,{base64.b64encode(data).decode()}"


def decode_data_url(url: Any, field: str) -> bytes:
    """The bytes of a ``data:<mime>;base64,...`` URL; 400 naming ``field`` otherwise (nothing is fetched)."""
    if not isinstance(url, str) or not url.startswith("data:"):
        raise ApiError(
            400,
            f"{field}: expected a data URL (data:image/png;base64,...); this server fetches no http(s) URLs",
            param=field,
        )
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise ApiError(400, f"{field}: the data URL must be base64 (data:image/png;base64,...)", param=field)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(
            400, f"{field}: the data URL's payload is not valid base64 ({exc})", param=field
        ) from exc


def reference_upload(value: Any, field: str) -> Upload:
    """An image given in JSON, as OpenAI's ``{"image_url": "data:..."}`` or a bare data URL string."""
    url = value.get("image_url") if isinstance(value, dict) else value
    if isinstance(url, dict):  # the chat-style {"image_url": {"url": ...}}
        url = url.get("url")
    return Upload(field, "image", decode_data_url(url, field))


def _first_image(body: ChatCompletionRequest) -> Upload | None:
    """The first ``image_url`` part of the user messages (vLLM-Omni also reads only user messages)."""
    for i, message in enumerate(body.messages):
        if message.role != "user" or isinstance(message.content, str):
            continue
        for j, part in enumerate(message.content):
            if part.type == "image_url":
                field = f"messages[{i}].content[{j}].image_url"
                return Upload(field, "image", decode_data_url(part.image_url.url, field))
    return None


def chat_generation(body: ChatCompletionRequest) -> tuple[ChatImageParams, Upload | None]:
    """The generation parameters and input image of a chat completion on a diffusion model.

    Parameters are the flattened top-level extras merged with a nested ``extra_body`` (the nested values win,
    as in vLLM-Omni, which reads only the nested dict when there is one)."""
    extras = dict(body.model_extra or {})
    nested = extras.pop("extra_body", None) or {}
    if not isinstance(nested, dict):
        raise ApiError(400, "extra_body must be a JSON object of generation parameters", param="extra_body")
    merged = {**extras, **nested}
    if "cfg_scale" in merged:  # vLLM-Omni's alias
        merged.setdefault("true_cfg_scale", merged.pop("cfg_scale"))
    for name in ("seed", "model"):  # the standard chat fields, as a fallback (``model`` may name an adapter)
        if merged.get(name) is None and getattr(body, name) is not None:
            merged[name] = getattr(body, name)
    if "lora" not in merged and body.lora is not None:
        lora = body.lora
        merged["lora"] = [x.model_dump() for x in lora] if isinstance(lora, list) else lora.model_dump()
    prompt = " ".join(m.text(" ") for m in body.messages if m.role == "user").strip()
    if not prompt:
        raise ApiError(
            400, "messages: no text in the user messages; the prompt is their text", param="messages"
        )
    try:
        params = ChatImageParams.model_validate({**merged, "prompt": prompt})
    except ValidationError as exc:
        message, param = describe_validation_errors(list(exc.errors()))
        raise ApiError(400, message, param=param, code="invalid_request") from exc
    return params, _first_image(body)


def chat_media_body(model: str, prompt: str, urls: list[list[str]], part: str = "image_url") -> dict:
    """vLLM-Omni's diffusion chat answer: one choice per list of ``urls`` (OpenAI's ``n``), each with one
    ``image_url`` (``audio_url`` for sound) part per output (``num_outputs_per_prompt``)."""
    outputs = sum(len(choice) for choice in urls)
    body = chat_completion(model, None, "stop", _media_usage(prompt, outputs))
    body["choices"] = [
        {**body["choices"][0], "index": i, "message": {"role": "assistant", "content": _parts(part, choice)}}
        for i, choice in enumerate(urls)
    ]
    return body


def _parts(part: str, urls: list[str]) -> list[dict]:
    return [{"type": part, part: {"url": url}} for url in urls]


def chat_audio_body(model: str, prompt: str, files: list[bytes]) -> dict:
    """OpenAI's answer to ``modalities: ["audio"]``: one choice per file (``n``), each with no text content and
    its file in ``message.audio.data``."""
    body = chat_completion(model, None, "stop", _media_usage(prompt, len(files)))
    body["choices"] = [
        {
            **body["choices"][0],
            "index": i,
            "message": {
                "role": "assistant",
                "content": None,
                "audio": {
                    "id": f"audio_{uuid.uuid4().hex}",
                    "data": base64.b64encode(data).decode(),
                    "expires_at": int(time.time()) + 3600,
                    "transcript": "",
                },
            },
        }
        for i, data in enumerate(files)
    ]
    return body


def _media_usage(prompt: str, outputs: int) -> dict:
    prompt_tokens = len(prompt.split())
    return {"prompt_tokens": prompt_tokens, "completion_tokens": outputs, "total_tokens": prompt_tokens + outputs}
