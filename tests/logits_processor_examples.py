"""Custom logits processors for the tests (importable by name: `--logits-processors logits_processor_examples:...`),
written as one writes them for vLLM."""
from __future__ import annotations

import torch

from pagedllm.logits_processor import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor, process_dict_updates
from pagedllm.sampling_params import SamplingParams


class TargetTokenLogitsProcessor(LogitsProcessor):
    """A request with extra_args {"target_token": t} can only generate t (vLLM's DummyLogitsProcessor)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and (not isinstance(target, int) or target < 0):
            raise ValueError(f"target_token must be a token id (int >= 0), got {target!r}")

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.targets: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.targets, batch_update,
                             lambda params, _prompt, _out: (params.extra_args or {}).get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, target in self.targets.items():
            keep = logits[index, target].clone()
            logits[index].fill_(float("-inf"))
            logits[index, target] = keep
        return logits


class NoRepeatLogitsProcessor(AdapterLogitsProcessor):
    """V0-style per-request callables: a request with extra_args {"no_repeat": true} never repeats its last
    token; {"no_repeat": "prompt"} also never generates its prompt's last token (the three-argument form)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        mode = (params.extra_args or {}).get("no_repeat")
        if not mode:
            return None
        if mode == "prompt":
            def ban_prompt_end(prompt_ids, output_ids, row):
                row[(output_ids or prompt_ids)[-1]] = float("-inf")
                row[prompt_ids[-1]] = float("-inf")
                return row
            return ban_prompt_end

        def ban_last(output_ids, row):
            if output_ids:
                row[output_ids[-1]] = float("-inf")
            return row
        return ban_last
