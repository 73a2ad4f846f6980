"""Logging config files, as vLLM's: a JSON object in logging.config.dictConfig's form, named by `serve
--log-config-file` or by VLLM_LOGGING_CONFIG_PATH. The server applies it at start-up and exports the variable, so
its engine-core process and tensor-parallel workers apply the same file (vLLM configures every process from the
variable)."""
from __future__ import annotations

import json
import logging.config
import os
from pathlib import Path
from typing import Any

#: vLLM's variable naming a logging config file (what `serve --log-config-file` defaults to).
LOGGING_CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"


def read_log_config(path: str, source: str = "--log-config-file") -> dict[str, Any]:
    """The JSON object of a logging config file. `source` (the flag or the variable that named the file) starts
    each ValueError, which says what is wrong."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{source} {path!r}: no such file (expected a JSON file in logging.config.dictConfig "
                         "form).")
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{source} {path!r}: cannot read it: {e}") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{source} {path!r}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{source} {path!r}: expected a JSON object in logging.config.dictConfig form "
                         f"(e.g. {{\"version\": 1, \"handlers\": {{...}}, \"root\": {{...}}}}), got a JSON "
                         f"{type(config).__name__}.")
    return config


def apply_log_config(path: str, source: str = "--log-config-file") -> dict[str, Any]:
    """Read the file (read_log_config) and apply it with logging.config.dictConfig; returns the config."""
    config = read_log_config(path, source)
    try:
        logging.config.dictConfig(config)
    except (ValueError, TypeError, AttributeError, ImportError, KeyError) as e:
        raise ValueError(f"{source} {path!r}: logging.config.dictConfig refused it: {e}") from None
    return config


def apply_log_config_from_env(process: str) -> None:
    """In a process the server spawned (its engine core, a tensor-parallel worker): the file VLLM_LOGGING_CONFIG_PATH
    names, applied here too. A file that no longer reads is one warning (naming `process`), and logging stays as is."""
    path = os.environ.get(LOGGING_CONFIG_ENV)
    if not path:
        return
    try:
        apply_log_config(path, LOGGING_CONFIG_ENV)
    except ValueError as e:  # the server applied it at start-up: the file changed since
        logging.getLogger("pagedllm").warning("%s: %s; logging to stderr instead", process, e)
