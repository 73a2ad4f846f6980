"""POST /classify: a sequence-classification model's class probabilities per input, with the most likely
class's label (vLLM's route)."""
from __future__ import annotations

import time

from pagedllm.entrypoints.openai.protocol import UsageInfo, dump
from pagedllm.entrypoints.openai.protocol_classification import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
)
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIError,
    ServingContext,
    final_outputs,
    request_ids,
)
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams


class OpenAIServingClassification:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_classify(self, req: ClassificationRequest, client_request_id: str | None = None,
                              route: str = "/classify") -> dict:
        """The response dict; raises OpenAIError (a 400 for what the request got wrong)."""
        ctx = self.ctx
        model = ctx.check_model(req.model)
        ctx.check_runner("pooling", route, "a classification model (*ForSequenceClassification)")
        ctx.check_pooling_task("classify", route)
        _, ids = ctx.completion_prompts(req.input, add_special_tokens=req.add_special_tokens, param="input")
        ids = [ctx.truncate(p, req.truncate_prompt_tokens) for p in ids]
        for prompt_ids in ids:
            ctx.check_length(len(prompt_ids), None, "input", "input")
        params = PoolingParams(task="classify", activation=req.activation)
        request_id, engine_prefix = request_ids("classify", client_request_id)
        streams = await ctx.add_all(ids, params, engine_prefix, req.priority)
        finals: list[PoolingRequestOutput | None] = await final_outputs(ctx, streams)
        labels = ctx.engine.request_checker.labels
        data, n_prompt = [], 0
        for i, out in enumerate(finals):
            if out is None or out.outputs.data is None:
                raise OpenAIError("the request ended without class probabilities", status=500, type="server_error")
            n_prompt += len(out.prompt_token_ids)
            probs = [float(p) for p in out.outputs.data.tolist()]
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append(ClassificationData(index=i, label=labels[best] if best < len(labels) else None, probs=probs,
                                           num_classes=len(probs)))
        usage = UsageInfo(prompt_tokens=n_prompt, total_tokens=n_prompt)
        return dump(ClassificationResponse(id=request_id, created=int(time.time()), model=model, data=data,
                                           usage=usage))
