"""vLLM's log-probability records: what `CompletionOutput.logprobs` and `RequestOutput.prompt_logprobs` hold."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position (vLLM's `Logprob`).

    ``rank`` is 1 for the most likely token, and for the chosen (sampled or prompt) token 1 + the number of other
    tokens at least as likely; ``decoded_token`` is the token's text when the request detokenizes, else None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: Per generated token: the token and the top-`logprobs` tokens → their `Logprob`.
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt position (None for the first): the prompt token and the top-`prompt_logprobs` tokens.
PromptLogprobs = list[dict[int, Logprob] | None]


def position_logprobs(token_id: int, logprob: float, rank: int | None,
                      top_ids: Seq[int], top_logprobs: Seq[float]) -> dict[int, Logprob]:
    """One position's dict: the chosen token first, then the most likely tokens in order (ranks 1, 2, …); the
    chosen token keeps its own entry when it is also among the top."""
    d = {token_id: Logprob(logprob, rank)}
    for j, (t, v) in enumerate(zip(top_ids, top_logprobs), 1):
        if t not in d:
            d[t] = Logprob(v, j)
    return d
