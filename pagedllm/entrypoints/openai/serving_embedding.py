"""POST /v1/embeddings: one pooling request per input, the vectors as floats or base64 (OpenAI's wire format)."""
from __future__ import annotations

import base64
import time

import numpy as np

from pagedllm.entrypoints.openai.protocol import UsageInfo, dump
from pagedllm.entrypoints.openai.protocol_embeddings import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
)
from pagedllm.entrypoints.openai.serving_chat import render_messages
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIError,
    ServingContext,
    final_outputs,
    request_ids,
)
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams


def encode_embedding(values, encoding_format: str) -> list[float] | str:
    """OpenAI's two encodings: a list of floats, or the little-endian float32 bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode("ascii")
    return [float(v) for v in values]


def input_prompts(ctx: ServingContext, req: EmbeddingRequest) -> list[list[int]]:
    """The token ids of an embedding (or /pooling) request's `input` or `messages`, truncated as it asks and
    within the length limit."""
    if (req.input is None) == (req.messages is None):
        raise OpenAIError("give exactly one of input (text or token ids) or messages (a chat conversation).",
                          param="input")
    if req.messages is not None:
        prompts = [render_messages(ctx, req)]
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        _, prompts = ctx.completion_prompts(req.input, add_special_tokens=add_special, param="input")
    ids = [ctx.truncate(p, req.truncate_prompt_tokens) for p in prompts]
    for prompt_ids in ids:
        ctx.check_length(len(prompt_ids), None, "input", "input")
    return ids


class OpenAIServingEmbedding:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_embedding(self, req: EmbeddingRequest, client_request_id: str | None = None) -> dict:
        """The response dict; raises OpenAIError (a 400 for what the request got wrong)."""
        model = self.ctx.check_model(req.model)
        self.ctx.check_runner("pooling", "/v1/embeddings")
        self.ctx.check_pooling_task("embed", "/v1/embeddings")
        ids = input_prompts(self.ctx, req)
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize, task="embed")
        try:
            self.ctx.engine.request_checker.check_pooling_params(params)
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions") from None
        request_id, engine_prefix = request_ids("embd", client_request_id)
        streams = await self.ctx.add_all(ids, params, engine_prefix, req.priority)
        finals: list[PoolingRequestOutput | None] = await final_outputs(self.ctx, streams)
        data, n_prompt = [], 0
        for i, out in enumerate(finals):
            if out is None or out.outputs.data is None:
                raise OpenAIError("the request ended without an embedding", status=500, type="server_error")
            n_prompt += len(out.prompt_token_ids)
            data.append(EmbeddingResponseData(index=i, embedding=encode_embedding(out.outputs.data.tolist(),
                                                                                  req.encoding_format)))
        usage = UsageInfo(prompt_tokens=n_prompt, total_tokens=n_prompt)
        return dump(EmbeddingResponse(id=request_id, created=int(time.time()), model=model, data=data, usage=usage))
