"""vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: serve a LoRA adapter folder under
``--lora-root`` by name from now on, or stop serving one. Refused off loopback without ``--api-key``."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from hsdp.serve.routes.common import ServerDep
from hsdp.serve.schemas import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, server: ServerDep) -> PlainTextResponse:
    """Checked against the base and the adapter slots now; copied onto the ranks when first used."""
    # Off the event loop: checking the folder builds the model on meta.
    await asyncio.to_thread(server.load_adapter, body.lora_name, body.lora_path, "lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, server: ServerDep) -> PlainTextResponse:
    server.unload_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
