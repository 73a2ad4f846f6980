"""Where pagedllm keeps files it derives once and reuses (converted GGUF weights, built CPU kernels)."""
from __future__ import annotations

import os
from pathlib import Path


def pagedllm_cache_dir(sub: str) -> Path:
    """``$PAGEDLLM_CACHE_DIR/<sub>``, else ``$XDG_CACHE_HOME/pagedllm/<sub>`` or ``~/.cache/pagedllm/<sub>``."""
    env = os.environ.get("PAGEDLLM_CACHE_DIR")
    if env:
        return Path(env).expanduser() / sub
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "pagedllm" / sub
