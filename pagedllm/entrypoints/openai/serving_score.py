"""POST /score (/v1/score) and /rerank (/v1/rerank, /v2/rerank): scores of text pairs, as vLLM serves them.

A cross-encoder (a classifier with one label) runs each pair as one prompt (entrypoints/score_utils.py) and scores
it with the sigmoid of its logit; an embedding model embeds every text once and scores the cosine similarity of the
two embeddings. Rerank scores each document against the query and returns them most relevant first."""
from __future__ import annotations

import time
from typing import Any

from pagedllm.entrypoints.openai.protocol import UsageInfo, dump
from pagedllm.entrypoints.openai.protocol_score import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from pagedllm.entrypoints.openai.serving_common import (
    OpenAIError,
    ServingContext,
    final_outputs,
    request_ids,
)
from pagedllm.entrypoints.score_utils import cosine_score, score_pairs, score_prompt
from pagedllm.outputs import PoolingRequestOutput
from pagedllm.pooling_params import PoolingParams

_WHAT = "a cross-encoder (a classifier with one label) or an embedding model"


def _side(value: Any, newer: Any, name: str, newer_name: str) -> tuple[list[str], str]:
    """One side of a score request (`text_1` or its newer name `queries`; `text_2` or `documents`) as a list of
    texts, and the field it came from."""
    if value is not None and newer is not None:
        raise OpenAIError(f"give {name} or {newer_name} (its newer name), not both.", param=newer_name)
    if value is None and newer is None:
        raise OpenAIError(f"{name} (or {newer_name}) is required: a string or a list of strings.", param=name)
    field = name if value is not None else newer_name
    texts = value if value is not None else newer
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise OpenAIError(f"{field} must not be empty: give a string or a list of strings.", param=field)
    return texts, field


class OpenAIServingScore:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create_score(self, req: ScoreRequest, client_request_id: str | None = None,
                           route: str = "/v1/score") -> dict:
        """The response dict; raises OpenAIError (a 400 for what the request got wrong)."""
        model = self._check_model(req.model, route)
        texts_1, name_1 = _side(req.text_1, req.queries, "text_1", "queries")
        texts_2, name_2 = _side(req.text_2, req.documents, "text_2", "documents")
        request_id, engine_prefix = request_ids("score", client_request_id)
        scores, n_prompt = await self._scores(texts_1, texts_2, (name_1, name_2), req.truncate_prompt_tokens,
                                              req.activation, req.priority, engine_prefix)
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        usage = UsageInfo(prompt_tokens=n_prompt, total_tokens=n_prompt)
        return dump(ScoreResponse(id=request_id, created=int(time.time()), model=model, data=data, usage=usage))

    async def create_rerank(self, req: RerankRequest, client_request_id: str | None = None,
                            route: str = "/v1/rerank") -> dict:
        """The documents most relevant first (the `top_n` best; 0: all of them); raises OpenAIError."""
        model = self._check_model(req.model, route)
        if req.top_n < 0:
            raise OpenAIError(f"top_n must be 0 (every document) or a positive count, got {req.top_n}.",
                              param="top_n")
        if not req.documents:
            raise OpenAIError("documents must not be empty: give at least one document to rank.", param="documents")
        request_id, engine_prefix = request_ids("rerank", client_request_id)
        scores, n_prompt = await self._scores([req.query], req.documents, ("query", "documents"),
                                              req.truncate_prompt_tokens, req.activation, req.priority, engine_prefix)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[: req.top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in order]
        usage = RerankUsage(prompt_tokens=n_prompt, total_tokens=n_prompt)
        return dump(RerankResponse(id=request_id, model=model, results=results, usage=usage))

    # -- internals -------------------------------------------------------------------------------------
    def _check_model(self, model: str | None, route: str) -> str:
        name = self.ctx.check_model(model)
        self.ctx.check_runner("pooling", route, _WHAT)
        self.ctx.check_pooling_task("score", route)
        return name

    async def _scores(self, texts_1: list[str], texts_2: list[str], names: tuple[str, str], truncate: int | None,
                      activation: bool | None, priority: int, engine_prefix: str) -> tuple[list[float], int]:
        """The pairs' scores (1→N or N→N) and the prompt tokens they took."""
        ctx = self.ctx
        try:
            pairs = score_pairs(len(texts_1), len(texts_2), names)
        except ValueError as e:
            raise OpenAIError(str(e), param=names[1]) from None
        cross_encoder = ctx.engine.request_checker.pooling_task == "classify"
        params = PoolingParams(task="score" if cross_encoder else "embed", activation=activation)
        try:
            ctx.engine.request_checker.check_pooling_params(params)
        except ValueError as e:
            raise OpenAIError(str(e), param="activation") from None
        if cross_encoder:
            ctx.limits.check_prompt_count(len(pairs))
            encoded = [score_prompt(ctx.tokenizer, texts_1[i], texts_2[j]) for i, j in pairs]
            prompts = [e["prompt_token_ids"] for e in encoded]
            sides = [names[0]] * len(prompts)
        else:  # every text embedded once
            encoded = None
            _, prompts = ctx.completion_prompts(texts_1 + texts_2, param=names[0])
            sides = [names[0]] * len(texts_1) + [names[1]] * len(texts_2)
        prompts = [ctx.truncate(p, truncate) for p in prompts]
        # A BERT pair's token types (its second segment), cut as truncation cut the ids (their last tokens kept).
        extras = [{"token_type_ids": e["token_type_ids"][len(e["token_type_ids"]) - len(p):]}
                  if "token_type_ids" in e else {} for e, p in zip(encoded, prompts)] if encoded else None
        total = 0
        for ids, side in zip(prompts, sides):
            ctx.check_length(len(ids), None, side, side)
            total += len(ids)
            ctx.limits.check_total_tokens(total)
        streams = await ctx.add_all(prompts, params, engine_prefix, priority, prompt_extras=extras)
        finals: list[PoolingRequestOutput | None] = await final_outputs(ctx, streams)
        if any(out is None or out.outputs.data is None for out in finals):
            raise OpenAIError("the request ended without a score", status=500, type="server_error")
        if cross_encoder:
            scores = [float(out.outputs.data.reshape(-1)[0]) for out in finals]
        else:
            n_1 = len(texts_1)
            scores = [cosine_score(finals[i].outputs.data, finals[n_1 + j].outputs.data) for i, j in pairs]
        return scores, total
