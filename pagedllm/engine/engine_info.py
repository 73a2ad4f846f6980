"""What the API server needs to know of an engine it may not hold (the engine-core process has it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.request_checker import RequestChecker


@dataclass(frozen=True)
class EngineInfo:
    model_dir: str
    has_tokenizer: bool
    device: str
    dtype: str
    checker: RequestChecker
    #: SamplingParams keyword defaults from the model's generation config (engine/generation_defaults.py)
    default_sampling_params: dict = field(default_factory=dict)

    @property
    def max_seq_len(self) -> int:
        return self.checker.max_seq_len

    @classmethod
    def of(cls, engine) -> EngineInfo:
        """Describe an `LLMEngine` (plain data: it pickles across processes)."""
        return cls(model_dir=str(engine.model_dir), has_tokenizer=engine.tokenizer is not None,
                   device=str(engine.executor.device), dtype=str(engine.executor.dtype).replace("torch.", ""),
                   checker=engine.request_checker, default_sampling_params=dict(engine.default_sampling_params))
