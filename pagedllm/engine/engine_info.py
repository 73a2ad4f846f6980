"""What the API server needs to know of an engine it may not hold (the engine-core process has it)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.request_checker import RequestChecker


@dataclass(frozen=True)
class EngineInfo:
    model_dir: str
    has_tokenizer: bool
    device: str
    dtype: str
    checker: RequestChecker

    @property
    def max_seq_len(self) -> int:
        return self.checker.max_seq_len

    @classmethod
    def of(cls, engine) -> EngineInfo:
        """Describe an `LLMEngine` (plain data: it pickles across processes)."""
        return cls(model_dir=str(engine.model_dir), has_tokenizer=engine.tokenizer is not None,
                   device=str(engine.executor.device), dtype=str(engine.executor.dtype).replace("torch.", ""),
                   checker=engine.request_checker)
