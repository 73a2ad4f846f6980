"""Mamba-1 (``MambaForCausalLM``: state-spaces/mamba-*-hf) and FalconMamba (``FalconMambaForCausalLM``:
tiiuae/falcon-mamba-7b): every layer a pre-norm Mamba-1 mixer (model/layers/mamba1.py), no attention and so no KV cache;
each sequence's state lives in its state slot. The layout and checkpoint names are Mamba-2's (models/mamba2.py);
FalconMamba normalises dt, B and C by RMS without weights."""
from __future__ import annotations

from typing import Any

from pagedllm.model.layers.mamba1 import Mamba1Dims, Mamba1Mixer
from pagedllm.model.models.mamba2 import Mamba2ForCausalLM


def mamba1_dims(config: Any, inner_norm: str | None = None) -> Mamba1Dims:
    """The mixer geometry of a ``MambaConfig`` / ``FalconMambaConfig``."""
    hidden = int(config.hidden_size)
    inter = int(getattr(config, "intermediate_size", None) or int(config.expand) * hidden)
    rank = config.time_step_rank
    rank = -(-hidden // 16) if rank == "auto" else int(rank)
    return Mamba1Dims(hidden_size=hidden, intermediate=inter, d_state=int(config.state_size),
                      d_conv=int(config.conv_kernel), dt_rank=rank,
                      conv_bias=bool(getattr(config, "use_conv_bias", True)),
                      proj_bias=bool(getattr(config, "use_bias", False)),
                      eps=float(getattr(config, "layer_norm_epsilon", 1e-5)), inner_norm=inner_norm,
                      inner_eps=float(getattr(config, "mixer_rms_eps", 1e-6)),
                      activation=getattr(config, "hidden_act", "silu"))


class MambaForCausalLM(Mamba2ForCausalLM):
    """Pure Mamba-1: no attention layers, one state slot per running sequence."""

    mixer_cls = Mamba1Mixer

    @classmethod
    def mixer_dims(cls, config: Any) -> Mamba1Dims:
        return mamba1_dims(config)


class FalconMambaForCausalLM(MambaForCausalLM):
    """FalconMamba: Mamba-1 with dt, B and C normalised by RMS (no weights) before use."""

    @classmethod
    def mixer_dims(cls, config: Any) -> Mamba1Dims:
        return mamba1_dims(config, inner_norm="weightless")
