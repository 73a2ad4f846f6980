"""Counters of speculative decoding (vLLM's metric names), read by `LLMEngine.stats()`."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_speculative_tokens: int
    num_drafts: int = 0  # verification rows: sequences that speculated in a step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted drafts + the target's own token per draft
    num_spec_steps: int = 0
    num_steps_off_by_batch: int = 0
    num_steps_off_by_rate: int = 0  # plain asynchronous steps measured faster than speculation (spec_decode/mode.py)
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens
        self.drafted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        for i in range(num_drafted):
            self.drafted_per_pos[i] += 1
            if i < num_accepted:
                self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_emitted_tokens": self.num_emitted_tokens,
            "spec_decode_num_spec_steps": self.num_spec_steps,
            "spec_decode_num_steps_off_by_batch": self.num_steps_off_by_batch,
            "spec_decode_num_steps_off_by_rate": self.num_steps_off_by_rate,
            "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens else 0.0,
            # Mean tokens a speculating sequence gains per step (accepted + 1).
            "spec_decode_mean_acceptance_length": self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0,
        }
        for i, (a, n) in enumerate(zip(self.accepted_per_pos, self.drafted_per_pos)):
            d[f"spec_decode_acceptance_rate_pos_{i}"] = a / n if n else 0.0
        return d
