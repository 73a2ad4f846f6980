"""POST /pooling: vLLM's generic pooling route, for every pooling task a model does (embed, classify, score and the
per-token token_embed / token_classify); inputs as /v1/embeddings takes them."""
from __future__ import annotations

import base64
import time

import numpy as np

from pagedllm.entrypoints.openai.protocol import UsageInfo, dump
from pagedllm.entrypoints.openai.protocol_pooling import PoolingRequest, PoolingResponse, PoolingResponseData
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIError,
    ServingContext,
    final_outputs,
    request_ids,
)
from pagedllm.entrypoints.openai.serving_embedding import input_prompts
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams


def encode_pooled(data, encoding_format: str) -> list[float] | list[list[float]] | str:
    """A pooled tensor as JSON: its values as nested lists (one list per token for the token tasks), or in base64
    the little-endian float32 bytes of the values in row order (vLLM's)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(data.tolist(), dtype="<f4").tobytes()).decode("ascii")
    return data.tolist()


class OpenAIServingPooling:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    def _params(self, req: PoolingRequest) -> PoolingParams:
        classifier = self.ctx.engine.request_checker.pooling_task in ("classify", "token_classify")
        activation, normalize = req.activation, req.normalize
        if req.use_activation is not None:  # vLLM's one switch: a classifier's activation, an embedding's norm
            if classifier and activation is None:
                activation = req.use_activation
            elif not classifier and normalize is None:
                normalize = req.use_activation
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=normalize, activation=activation,
                                   task=req.task or "encode")
            self.ctx.engine.request_checker.check_pooling_params(params)
        except ValueError as e:
            raise OpenAIError(str(e)) from None  # (the task was checked before: a field's value, named in it)
        return params

    async def create_pooling(self, req: PoolingRequest, client_request_id: str | None = None) -> dict:
        """The response dict; raises OpenAIError (a 400 for what the request got wrong)."""
        ctx = self.ctx
        model = ctx.check_model(req.model)
        ctx.check_runner("pooling", "/pooling", "a pooling model")
        ctx.check_pooling_task(req.task or "encode", "/pooling")
        params = self._params(req)
        ids = input_prompts(ctx, req)
        request_id, engine_prefix = request_ids("pool", client_request_id)
        streams = await ctx.add_all(ids, params, engine_prefix, req.priority)
        finals: list[PoolingRequestOutput | None] = await final_outputs(ctx, streams)
        data, n_prompt = [], 0
        for i, out in enumerate(finals):
            if out is None or out.outputs.data is None:
                raise OpenAIError("the request ended without a pooled result", status=500, type="server_error")
            n_prompt += len(out.prompt_token_ids)
            data.append(PoolingResponseData(index=i, data=encode_pooled(out.outputs.data, req.encoding_format)))
        usage = UsageInfo(prompt_tokens=n_prompt, total_tokens=n_prompt)
        return dump(PoolingResponse(id=request_id, created=int(time.time()), model=model, data=data, usage=usage))
