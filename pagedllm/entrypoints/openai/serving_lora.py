"""vLLM's runtime LoRA routes, served when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true: POST /v1/load_lora_adapter and
POST /v1/unload_lora_adapter add and drop --lora-modules entries while the server runs."""
from __future__ import annotations

import os
from pathlib import Path

from pagedllm.entrypoints.openai.protocol import RequestModel, Text
from pagedllm.entrypoints.openai.serving_common import OpenAIError, ServingContext, error_from_exception
from pagedllm.lora.request import LoRARequest

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: Text
    lora_path: Text


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: Text
    lora_int_id: int | None = None


class OpenAIServingLoRA:
    def __init__(self, ctx: ServingContext, enable_lora: bool) -> None:
        self.ctx, self.enable_lora = ctx, enable_lora

    def load(self, req: LoadLoRAAdapterRequest) -> str:
        if not self.enable_lora:
            raise OpenAIError("this server serves no LoRA adapters: start it with --enable-lora.", param="lora_name")
        name = req.lora_name
        if name in self.ctx.lora_modules or name in self.ctx.served_model_names:
            raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if not (Path(req.lora_path) / "adapter_config.json").is_file():
            raise OpenAIError(f"no PEFT adapter (adapter_config.json) at {req.lora_path!r}.", param="lora_path")
        next_id = max((lr.lora_int_id for lr in self.ctx.lora_modules.values()), default=0) + 1
        self.ctx.lora_modules[name] = LoRARequest(name, next_id, req.lora_path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        lora = self.ctx.lora_modules.get(req.lora_name)
        if lora is None or (req.lora_int_id is not None and req.lora_int_id != lora.lora_int_id):
            raise OpenAIError(f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                              code="not_found", status=404)
        try:
            await self.ctx.engine.remove_lora(lora.lora_int_id)
        except ValueError as e:  # requests still run with it
            raise OpenAIError(str(e), param="lora_name", code="conflict", status=409) from None
        except Exception as e:
            raise error_from_exception(e) from None
        del self.ctx.lora_modules[req.lora_name]
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."
