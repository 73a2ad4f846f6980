"""GGUF -> Hugging Face directory conversion (own code; transformers is used for the tokenizer only).

A GGUF file (llama.cpp format) is converted once into a cache directory holding ``config.json``,
``model.safetensors`` (float32), the tokenizer files and ``generation_config.json``; later calls
return the cached directory without opening the GGUF again. A MoE file's routed experts in a type that
quantization='gguf' serves from its blocks (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4) are not
copied: they stay in the GGUF, listed in the cache's marker file, and a float load dequantizes them from there
(loader.iterate_weights).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from pagedllm.cache_dir import pagedllm_cache_dir
from pagedllm.model.gguf_config import (
    GGUF_ARCHITECTURES,
    FUSED_PARTS,
    GLOBAL_TENSORS,
    ROPE_FACTOR_TENSORS,
    SUPPORTED_GGUF_ARCHITECTURES,
    GGUFArchitecture,
    GGUFModelInfo,
    build_config,
)
from pagedllm.model.gguf_deepseek import CORRECTION_BIAS, K_B, V_B, join_kv_b, mla_expected_shape
from pagedllm.model import gguf_gpt_oss
from pagedllm.model.gguf_mamba import (
    SSM_ARCHITECTURES,
    SharedMlpJoiner,
    map_ssm_tensor_name,
    ssm_expected_shape,
    ssm_outputs,
    ssm_tensor,
)
from pagedllm.model.gguf_moe import (
    dequantized_experts,
    is_expert_tensor,
    is_float_type,
    is_stacked_experts,
    keeps_blocks,
    legacy_expert_name,
    log_dequantized_experts,
    moe_expected_shape,
)

logger = logging.getLogger("pagedllm")

GGUF_MAGIC = b"GGUF"
# Bump when the converter output changes so that stale caches are not reused.
CONVERTER_VERSION = "2"
MARKER_FILE = "pagedllm_gguf_source.json"
# The marker's list of GGUF expert tensors the cache leaves in the source file (absent in caches of older versions,
# which hold every expert as float).
EXPERTS_IN_GGUF = "experts_in_gguf"
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")
# Tensors llama.cpp stores that have no HF counterpart and carry no information we need.
_IGNORED_SUFFIXES = ("attn_rot_embd.weight",)


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a file that starts with the GGUF magic bytes (suffix is not required)."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_cache_root() -> Path:
    """Root of converted GGUF caches: ``$PAGEDLLM_CACHE_DIR/gguf`` or ``~/.cache/pagedllm/gguf``."""
    return pagedllm_cache_dir("gguf")


def gguf_cache_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """Cache directory for one GGUF file; the key hashes its real path, size and mtime."""
    p = Path(gguf_path).resolve()
    st = p.stat()
    key_src = f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0{CONVERTER_VERSION}"
    key = hashlib.sha256(key_src.encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", p.stem)[:80]
    return gguf_cache_root() / f"{stem}-{key}"


def _is_complete_cache(d: Path) -> bool:
    return (d / MARKER_FILE).is_file() and (d / "config.json").is_file()


def get_or_convert_gguf(gguf_path: str | os.PathLike[str]) -> Path:
    """Return the cached HF directory for ``gguf_path``, converting it (atomically) on first use."""
    src = Path(gguf_path).resolve()
    target = gguf_cache_dir(src)
    if _is_complete_cache(target):
        return target
    root = target.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(
            f"Cannot create the GGUF cache directory {root}: {e}. "
            "Set PAGEDLLM_CACHE_DIR to a writable directory."
        ) from e
    _remove_stale_tmp_dirs(root)
    if target.exists():  # incomplete or tampered: a finished cache always has the marker file
        if _is_complete_cache(target):  # another process just finished it
            return target
        logger.warning("Removing incomplete GGUF cache %s", target)
        shutil.rmtree(target, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-{os.getpid()}-", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
    logger.info("Converting GGUF %s -> %s (one-time, cached afterwards)", src, target)
    t0 = time.perf_counter()
    try:
        convert_gguf(src, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete_cache(target):  # not a lost race with another process
                raise
            logger.info("Another process finished converting %s first; using its output", src)
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Converted %s in %.1f s", src.name, time.perf_counter() - t0)
    _remove_superseded_caches(root, src, target)
    return target


def _remove_superseded_caches(root: Path, src: Path, keep: Path) -> None:
    """Delete caches of the same source file made from an older version of it or of the converter."""
    for d in root.glob(keep.name.rsplit("-", 1)[0] + "-*"):
        if d == keep or d.name.startswith(".") or not (d / MARKER_FILE).is_file():
            continue
        try:
            source = json.loads((d / MARKER_FILE).read_text()).get("source")
        except (OSError, ValueError):
            continue
        if source == str(src):
            logger.info("Removing superseded GGUF cache %s", d)
            shutil.rmtree(d, ignore_errors=True)


def _remove_stale_tmp_dirs(root: Path) -> None:
    """Delete temp dirs (``.tmp-<name>-<pid>-<rand>``) of conversions whose process is gone."""
    for d in root.glob(".tmp-*"):
        parts = d.name.rsplit("-", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        pid_str = parts[1]
        try:
            os.kill(int(pid_str), 0)
        except ProcessLookupError:
            logger.info("Removing leftover temp dir of an interrupted conversion: %s", d)
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            pass  # alive but not ours (EPERM): leave it


# --------------------------------------------------------------------------------------------
# Reading


def open_gguf(path: str | os.PathLike[str]) -> Any:
    """Open ``path`` with ``gguf.GGUFReader``; any parse failure becomes a clear ValueError."""
    from gguf import GGUFReader

    p = Path(path)
    try:
        reader = GGUFReader(p)
    except Exception as e:  # the reader raises many kinds (ValueError, IndexError, struct/numpy errors)
        raise ValueError(
            f"{p} is not a valid GGUF file: {type(e).__name__}: {e} (is the file truncated or corrupt?)"
        ) from e
    size = p.stat().st_size
    for t in reader.tensors:
        if int(t.data_offset) + int(t.n_bytes) > size:
            raise ValueError(
                f"{p} is not a valid GGUF file: tensor {t.name!r} extends past the end of the file "
                f"({int(t.data_offset) + int(t.n_bytes)} > {size} bytes; is the file truncated?)"
            )
    return reader


# --------------------------------------------------------------------------------------------
# Tensor names and layout


def reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of q_proj/k_proj (``convert_hf_to_gguf.permute``).

    llama.cpp turns HF's "rotate-half" row order per head, (2, head_dim/2), into interleaved
    pairs, (head_dim/2, 2); this swaps them back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute a tensor with {rows} rows for {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _arch_spec(arch: str) -> GGUFArchitecture:
    spec = GGUF_ARCHITECTURES.get(arch)
    if spec is None:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return spec


def map_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """HF parameter name for a llama.cpp tensor name of architecture ``arch`` (None for tensors that are dropped
    or that build_config reads into the config)."""
    spec = _arch_spec(arch)
    if gguf_name.endswith(_IGNORED_SUFFIXES):
        return None
    if arch == "phi3" and gguf_name in ROPE_FACTOR_TENSORS:
        return None
    if arch in SSM_ARCHITECTURES:
        return map_ssm_tensor_name(gguf_name, arch)
    m = _BLOCK_RE.match(gguf_name)
    if arch == "deepseek2" and m and (m.group(2), m.group(3)) == (CORRECTION_BIAS[0], "bias"):
        return f"model.layers.{m.group(1)}.{CORRECTION_BIAS[1]}"
    if m and m.group(2) in spec.block_tensors and (spec.biases or m.group(3) == "weight"):
        name = f"model.layers.{m.group(1)}.{spec.block_tensors[m.group(2)]}.{m.group(3)}"
        return gguf_gpt_oss.hf_tensor_name(name) if arch == gguf_gpt_oss.ARCH else name
    m = _GLOBAL_RE.match(gguf_name)
    if m and m.group(1) in GLOBAL_TENSORS and (spec.biases or m.group(2) == "weight"):
        return f"{GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    if arch == "llama" and (legacy := legacy_expert_name(gguf_name)) is not None:
        return legacy  # a pre-April-2024 Mixtral file: one tensor per expert
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (Llama-3.1 style RoPE frequency scaling) is not supported yet"
        )
    kinds = "weight and bias" if spec.biases else "weight"
    raise ValueError(
        f"Unsupported tensor {gguf_name!r} in a GGUF file of architecture {arch!r}; expected {kinds} tensors "
        f"{', '.join(GLOBAL_TENSORS)} and blk.N.{{{', '.join(spec.block_tensors)}}}"
        + (f" (and {', '.join(ROPE_FACTOR_TENSORS)})" if arch == "phi3" else "")
    )


def _fused_rows(module: str, cfg: dict[str, Any]) -> tuple[int, ...]:
    """Rows of each part of a fused projection (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up)."""
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    ff = cfg["intermediate_size"]
    return (q, kv, kv) if module == "qkv_proj" else (ff, ff)


def _expected_shape(hf_name: str, cfg: dict[str, Any], qk_norm: str = "head") -> tuple[int, ...] | None:
    """The HF shape of ``hf_name`` the config implies (None: not checked); ``qk_norm``: GGUFArchitecture.qk_norm."""
    if (gpt_oss := gguf_gpt_oss.expected_shape(hf_name, cfg)) is not None:
        return gpt_oss
    if (moe := moe_expected_shape(hf_name, cfg)) is not None:
        return moe
    if (mla := mla_expected_shape(hf_name, cfg)) is not None:
        return mla
    h, hd, vocab = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"]
    q, kv, ff = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    module, kind = hf_name.split(".")[-2:]
    rows = {"embed_tokens": vocab, "lm_head": vocab, "q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h,
            "qkv_proj": q + 2 * kv, "gate_proj": ff, "up_proj": ff, "gate_up_proj": 2 * ff, "down_proj": h,
            "fc1": ff, "fc2": h}
    if module in rows:
        cols = {"o_proj": q, "down_proj": ff, "fc2": ff}.get(module, h)
        return (rows[module], cols) if kind == "weight" else (rows[module],)
    if module in ("q_norm", "k_norm"):
        heads = cfg["num_attention_heads"] if module == "q_norm" else cfg["num_key_value_heads"]
        return {"projection": (heads * hd,), "per_head": (heads, hd)}.get(qk_norm, (hd,))
    if module == "norm" or module.endswith("layernorm"):
        return (h,)
    return None


def iter_gguf_tensors(reader: Any, info: GGUFModelInfo, path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, float32 C-contiguous array in HF layout) for every tensor of the GGUF but the routed experts
    served from their blocks (:func:`experts_left_in_gguf`), merged experts split one matrix per expert."""
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    quantized_experts: list[str] = []  # types of the expert tensors dequantized (one log line at the end)
    names = {t.name for t in reader.tensors}
    split_kv_b: dict[str, dict[str, np.ndarray]] = {}  # deepseek2's attn_k_b / attn_v_b by layer, until both are read
    shared_mlp = SharedMlpJoiner()  # granitehybrid's shared MLP halves by layer, until both are read
    for t in tqdm(reader.tensors, desc="Dequantizing GGUF", unit="tensor", leave=False):
        hf_name = map_tensor_name(t.name, info.arch)
        if hf_name is None:
            continue
        if hf_name.endswith((K_B, V_B)) and t.name.rsplit(".", 2)[0] + ".attn_kv_b.weight" in names:
            continue  # a file with both forms: its attn_kv_b is kv_b_proj
        if is_expert_tensor(hf_name) and not gguf_gpt_oss.is_expert_bias(hf_name):
            # shapes checked; those served from their blocks left in the GGUF
            written = not keeps_blocks(hf_name, t.tensor_type.name)
            if written and not is_float_type(t.tensor_type.name):
                quantized_experts.append(t.tensor_type.name)
            yield from dequantized_experts(t, hf_name, info.config, path, wanted=lambda name, keep=written: keep)
            continue
        try:
            arr = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF tensor {t.name!r} in {path} uses an unsupported type: {e}") from e
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.owndata or not arr.flags.writeable:  # F32 comes back as a view of the memmap
            arr = arr.copy()
        if info.permuted_qk and ".attn_q." in t.name:
            arr = reverse_permute(arr, info.n_head)
        elif info.permuted_qk and ".attn_k." in t.name:
            arr = reverse_permute(arr, info.n_head_kv)
        if info.norm_offset and t.name.endswith("norm.weight"):
            arr -= np.float32(info.norm_offset)
        if info.arch in SSM_ARCHITECTURES:  # A = -exp(A_log), squeezed / grouped shapes undone (gguf_mamba.py)
            arr = ssm_tensor(hf_name, arr, info.arch)
            expected = ssm_expected_shape(hf_name, info.config)
            if expected is not None and tuple(arr.shape) != expected:
                raise ValueError(f"GGUF tensor {t.name!r} in {path} has shape {tuple(arr.shape)} (HF layout), "
                                 f"expected {expected} from the model metadata")
            if SharedMlpJoiner.is_half(hf_name):
                if (joined := shared_mlp.add(hf_name, arr)) is not None:
                    yield joined
            else:
                yield from ssm_outputs(hf_name, arr)  # nemotron_h_moe's stacked experts split per expert
            continue
        if hf_name.endswith(".mlp.shared_expert_gate.weight") and arr.ndim == 1:  # llama.cpp's {n_embd}
            arr = arr.reshape(1, -1)
        spec = GGUF_ARCHITECTURES[info.arch]
        expected = _expected_shape(hf_name, info.config, spec.qk_norm)
        if expected is not None and tuple(arr.shape) != expected:
            raise ValueError(
                f"GGUF tensor {t.name!r} in {path} has shape {tuple(arr.shape)}, expected {expected} "
                "from the model metadata"
            )
        if hf_name.endswith((K_B, V_B)):  # MLA's kv_b_proj split per head (newer converters): joined back
            prefix = hf_name[: -len(K_B)]
            pair = split_kv_b.setdefault(prefix, {})
            pair[hf_name[len(prefix):]] = arr
            if len(pair) == 2:
                del split_kv_b[prefix]
                yield f"{prefix}.self_attn.kv_b_proj.weight", join_kv_b(pair[K_B], pair[V_B])
            continue
        module, kind = hf_name.split(".")[-2:]
        if spec.split_fused and module in FUSED_PARTS:  # the class loads the parts (q/k/v_proj), not the fused name
            prefix, start = hf_name[: -len(f"{module}.{kind}")], 0
            for part, n in zip(FUSED_PARTS[module], _fused_rows(module, info.config)):
                yield f"{prefix}{part}.{kind}", np.ascontiguousarray(arr[start:start + n])
                start += n
            continue
        yield hf_name, arr
    shared_mlp.check_complete(path)
    if split_kv_b:
        prefix, pair = next(iter(split_kv_b.items()))
        have, missing = ("attn_k_b", "attn_v_b") if K_B in pair else ("attn_v_b", "attn_k_b")
        raise ValueError(f"{path}: layer {prefix.rsplit('.', 1)[-1]} has {have} but no {missing}: the two halves of "
                         "MLA's kv_b_proj come together (or attn_kv_b alone)")
    log_dequantized_experts(path, quantized_experts)


# --------------------------------------------------------------------------------------------
# Writing


def _write_weights(tensors: Iterator[tuple[str, np.ndarray]], out_dir: Path, max_shard_bytes: int) -> None:
    import torch
    from safetensors.torch import save_file

    shard_files: list[list[str]] = []  # tensor names per shard
    current: dict[str, torch.Tensor] = {}
    current_bytes = 0

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            save_file(current, str(out_dir / f"shard-{len(shard_files):05d}.tmp"), metadata={"format": "pt"})
            shard_files.append(list(current))
            current, current_bytes = {}, 0

    for name, arr in tensors:
        if current and current_bytes + arr.nbytes > max_shard_bytes:
            flush()
        current[name] = torch.from_numpy(arr)
        current_bytes += arr.nbytes
    flush()
    if not shard_files:
        raise ValueError("GGUF file contains no tensors")
    if len(shard_files) == 1:
        os.replace(out_dir / "shard-00000.tmp", out_dir / "model.safetensors")
        return
    n = len(shard_files)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shard_files):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out_dir / f"shard-{i:05d}.tmp", out_dir / fname)
        weight_map.update({k: fname for k in names})
    total = sum((out_dir / f).stat().st_size for f in set(weight_map.values()))
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def transformers_dense_gguf_kwargs() -> dict:
    """Keyword arguments for transformers' `from_pretrained(..., gguf_file=...)` that load the file as dense
    weights. This is what the references and peers mean: newer transformers keep the blocks packed instead, where
    the `kernels` package publishes a GGUF matmul for the device."""
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:  # transformers without packed GGUF weights: it always dequantizes
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _load_gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer built from the GGUF metadata of ``path``.

    AutoTokenizer first reads the model config from the file, which transformers cannot do for every architecture
    whose tokenizer it builds (Gemma 1); the fast tokenizer class reads the tokenizer keys alone."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    kwargs = dict(gguf_file=path.name, local_files_only=True)
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), **kwargs)
    except Exception as e:
        try:
            return PreTrainedTokenizerFast.from_pretrained(str(path.parent), **kwargs)
        except Exception:
            raise ValueError(f"Could not build a tokenizer from the GGUF metadata of {path}: {e}") from e


def _write_tokenizer(path: Path, out_dir: Path, info: GGUFModelInfo) -> None:
    if not info.has_tokenizer:
        logger.warning("GGUF %s has no tokenizer metadata; pass a tokenizer explicitly", path)
        return
    tok = _load_gguf_tokenizer(path)
    if info.chat_template and not tok.chat_template:
        tok.chat_template = info.chat_template
    tok.model_max_length = info.config["max_position_embeddings"]
    tok.save_pretrained(str(out_dir))
    # Make the saved config portable: drop load-time kwargs, name a class transformers 4.x knows and
    # keep the chat template in tokenizer_config.json too (older versions ignore chat_template.jinja).
    cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only", "gguf_file"):
        tok_cfg.pop(key, None)
    if tok_cfg.get("tokenizer_class") == "TokenizersBackend":
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if tok.chat_template and "chat_template" not in tok_cfg:
        tok_cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                 max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Convert ``gguf_path`` into an HF-style directory ``out_dir`` (which must exist)."""
    from transformers import AutoConfig, GenerationConfig

    src, out = Path(gguf_path), Path(out_dir)
    reader = open_gguf(src)
    info = build_config(reader, src)
    _write_weights(iter_gguf_tensors(reader, info, src), out, max_shard_bytes)
    left = experts_left_in_gguf(reader, info)
    del reader

    AutoConfig.for_model(**info.config).save_pretrained(str(out))
    gen = {k: info.config[k] for k in ("bos_token_id", "pad_token_id") if info.config[k] is not None}
    if info.eos_token_ids:
        gen["eos_token_id"] = info.eos_token_ids[0] if len(info.eos_token_ids) == 1 else info.eos_token_ids
    GenerationConfig(**gen).save_pretrained(str(out))
    _write_tokenizer(src, out, info)
    st = src.stat()
    (out / MARKER_FILE).write_text(json.dumps(
        {"source": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
         "converter_version": CONVERTER_VERSION, EXPERTS_IN_GGUF: left}, indent=2))


def experts_left_in_gguf(reader: Any, info: GGUFModelInfo) -> list[str]:
    """Names of the routed-expert tensors the cache does not hold: those in a type quantization='gguf' serves from
    its blocks (a float load dequantizes them from the GGUF: :func:`iter_experts_left_in_gguf`)."""
    return [t.name for t in reader.tensors if (hf_name := map_tensor_name(t.name, info.arch)) is not None
            and keeps_blocks(hf_name, t.tensor_type.name)]


def iter_experts_left_in_gguf(model_dir: Path, wanted: Callable[[str], bool]) -> Iterator[tuple[str, np.ndarray]]:
    """The ``wanted`` per-expert matrices of the expert tensors a converted cache left in its source GGUF (its
    marker's ``experts_in_gguf``), float32, dequantized from the file one expert matrix at a time; nothing for other
    directories and for caches of older versions (which hold every expert as float)."""
    marker = model_dir / MARKER_FILE
    if not marker.is_file():
        return
    meta = json.loads(marker.read_text())
    names = meta.get(EXPERTS_IN_GGUF) or []
    if not names:
        return
    src = Path(meta["source"])
    st = src.stat() if src.is_file() else None
    if st is None or (st.st_size, st.st_mtime_ns) != (meta.get("size"), meta.get("mtime_ns")):
        why = "is missing" if st is None else "has changed since the conversion"
        raise ValueError(f"{model_dir} leaves {len(names)} quantized expert tensors in its source GGUF {src}, which "
                         f"{why}; load the .gguf file itself (pagedllm converts it again)")
    reader = open_gguf(src)
    info = build_config(reader, src)
    tensors = {t.name: t for t in reader.tensors}
    types: list[str] = []  # of the tensors dequantized (one log line at the end)
    for name in names:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"{src} has no tensor {name!r}, which {marker} lists; delete {model_dir} to reconvert")
        found = False
        for pair in dequantized_experts(t, map_tensor_name(name, info.arch), info.config, src, wanted):
            found = True
            yield pair
        if found:
            types.append(t.tensor_type.name)
    log_dequantized_experts(src, types)


# --------------------------------------------------------------------------------------------
# Quantized tensors kept as their GGUF blocks (--quantization gguf)


@dataclass(frozen=True)
class GGUFRawTensor:
    """One GGUF tensor as stored: ``blocks`` is uint8 [rows, row_bytes] (rows in HF order) for 2-D tensors."""

    hf_name: str
    type_name: str  # GGMLQuantizationType name: Q4_1, Q8_0, F32, ...
    type_code: int
    shape: tuple[int, ...]  # HF layout: (out_features, in_features) for matrices
    blocks: np.ndarray


def read_gguf_raw_tensors(path: str | os.PathLike[str]) -> tuple[dict[str, GGUFRawTensor], int]:
    """Every mapped tensor of ``path`` without dequantizing (q/k rows un-permuted; fused q|k|v (Phi-3, Phi-2,
    GPT-NeoX) and gate|up (Phi-3) split by rows into q/k/v_proj and gate/up_proj), and the file's tensor bytes.
    Gemma's norms, stored with +1, are left out: only the dense path (:func:`convert_gguf`) reads them. Merged expert
    tensors (MoE files) stay merged: ``blocks`` [experts, rows, row_bytes] under ``...mlp.experts.<proj>.weight``."""
    src = Path(path)
    reader = open_gguf(src)
    info = build_config(reader, src)
    out: dict[str, GGUFRawTensor] = {}
    total = 0
    for t in reader.tensors:
        total += int(t.n_bytes)
        hf_name = map_tensor_name(t.name, info.arch)
        if hf_name is None or (info.norm_offset and t.name.endswith("norm.weight")):
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists ne0 (innermost) first
        raw = np.asarray(t.data)
        module, kind = hf_name.split(".")[-2:]
        if len(shape) == 2:
            raw = raw.reshape(shape[0], -1)
            if info.permuted_qk and ".attn_q." in t.name:
                raw = reverse_permute(raw, info.n_head)
            elif info.permuted_qk and ".attn_k." in t.name:
                raw = reverse_permute(raw, info.n_head_kv)
        elif len(shape) == 3:
            raw = raw.reshape(shape[0], shape[1], -1)
        if module not in FUSED_PARTS or is_stacked_experts(hf_name):
            out[hf_name] = GGUFRawTensor(hf_name, t.tensor_type.name, int(t.tensor_type), shape, raw)
            continue
        rows = _fused_rows(module, info.config)
        if shape[0] != sum(rows):
            raise ValueError(f"GGUF tensor {t.name!r} in {src} has {shape[0]} rows, the model metadata implies "
                             f"{' + '.join(map(str, rows))}")
        prefix, start = hf_name[: -len(f"{module}.{kind}")], 0
        for part, n in zip(FUSED_PARTS[module], rows):
            name = f"{prefix}{part}.{kind}"
            out[name] = GGUFRawTensor(name, t.tensor_type.name, int(t.tensor_type), (n, *shape[1:]),
                                      raw[start:start + n])
            start += n
    return out, total
