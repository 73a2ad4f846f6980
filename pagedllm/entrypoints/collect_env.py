"""`pagedllm collect-env`: the environment report to attach to a bug report, as vLLM's ``collect_env``.

System (OS, libc, the C compiler the CPU kernels are built with), PyTorch (version, debug build, CUDA / ROCm it was
built with, threads), Python, CUDA / GPUs, the CPU (model, cores, the ISA level pagedllm builds its kernels for),
the versions of the relevant packages (read from their metadata: nothing but torch is imported) and every
``VLLM_*`` / ``PAGEDLLM_*`` variable set (with a few others that change behaviour: ``CUDA_VISIBLE_DEVICES``,
``OMP_NUM_THREADS``, ``HF_*``...), the values of those whose names hold KEY, TOKEN, SECRET or PASSWORD masked.
Every probe that fails reads "Could not collect"; no GPU and missing optional packages are fine.

    pagedllm collect-env            # or: python -m pagedllm.entrypoints.collect_env
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping

NA = "N/A"
NOT_COLLECTED = "Could not collect"
NOT_INSTALLED = "not installed"
MASK = "********"
# (label, distribution name): read with importlib.metadata, never imported.
RELEVANT_PACKAGES = (("torch", "torch"), ("transformers", "transformers"), ("tokenizers", "tokenizers"),
                     ("safetensors", "safetensors"), ("triton", "triton"), ("xgrammar", "xgrammar"),
                     ("llguidance", "llguidance"), ("fastapi", "fastapi"), ("uvicorn", "uvicorn"),
                     ("pydantic", "pydantic"), ("openai", "openai"), ("numpy", "numpy"), ("gguf", "gguf"))
ENV_PREFIXES = ("VLLM_", "PAGEDLLM_")
# Not pagedllm's own, but they change what it does (devices, threads, the Hub, torch's compiler).
OTHER_ENV_PREFIXES = ("CUDA_", "NCCL_", "OMP_", "MKL_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "TORCH_",
                      "TORCHINDUCTOR_", "TRITON_")
OTHER_ENV_NAMES = ("CC", "LD_LIBRARY_PATH")
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")

Section = tuple[str, list[tuple[str, str]]]


def _probe(fn: Callable[[], object]) -> str:
    """`fn()` as text; any failure (or an empty answer) reads "Could not collect"."""
    try:
        value = fn()
    except Exception:  # noqa: BLE001 (a report, not a program: any failure is "could not collect")
        return NOT_COLLECTED
    return NOT_COLLECTED if value is None or value == "" else str(value)


def _run(cmd: list[str]) -> str | None:
    """The first line of `cmd`'s output, or None if it cannot run."""
    if shutil.which(cmd[0]) is None and not os.path.isabs(cmd[0]):
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def _os_name() -> str:
    pretty = None
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    pretty = line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    if pretty is None and sys.platform == "darwin":
        pretty = f"macOS {platform.mac_ver()[0]}"
    return f"{pretty or platform.system() + ' ' + platform.release()} ({platform.machine()})"


def _c_compiler() -> str | None:
    """The compiler the CPU kernels use (pagedllm/kernels/cpu_kernels.py: $CC, else cc, else gcc) and its version."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return "none found (the CPU kernels need one)"
    return f"{cc}: {_run([cc, '--version']) or NOT_COLLECTED}"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model", "Hardware")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _cpu_isa() -> str:
    from pagedllm.kernels.cpu_isa import detect_cpu_isa

    try:
        isa = detect_cpu_isa()
    except ValueError as e:  # a PAGEDLLM_CPU_ISA that is not a level, or above the CPU's
        return f"error: {e}"
    return f"{isa.name} (detected: {isa.detected}; {isa.reason})"


def _cpu_count() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{os.cpu_count()} (usable by this process: {usable})"


def _torch_sections() -> tuple[Section, Section]:
    try:
        import torch
    except ImportError:
        return (("PyTorch Info", [("PyTorch version", NOT_INSTALLED)]),
                ("CUDA / GPU Info", [("Is CUDA available", "False (no torch)")]))
    version = torch.version
    pytorch = [
        ("PyTorch version", str(torch.__version__)),
        ("Is debug build", _probe(lambda: bool(version.debug))),
        ("CUDA used to build PyTorch", str(getattr(version, "cuda", None) or NA)),
        ("ROCM used to build PyTorch", str(getattr(version, "hip", None) or NA)),
        ("PyTorch threads", _probe(lambda: f"{torch.get_num_threads()} intra-op, "
                                           f"{torch.get_num_interop_threads()} inter-op")),
        ("PyTorch CPU capability", _probe(lambda: torch.backends.cpu.get_cpu_capability())),
    ]
    available = _probe(lambda: torch.cuda.is_available())
    gpu: list[tuple[str, str]] = [("Is CUDA available", available)]
    if available == "True":
        def gpus() -> str:
            rows = []
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                rows.append(f"GPU {i}: {p.name} ({p.total_memory / 2**30:.1f} GiB, compute capability "
                            f"{p.major}.{p.minor})")
            return "; ".join(rows)

        gpu += [
            ("CUDA runtime version", str(version.cuda or version.hip or NA)),
            ("GPU models and configuration", _probe(gpus)),
            ("Nvidia driver version", _probe(lambda: _run(["nvidia-smi", "--query-gpu=driver_version",
                                                           "--format=csv,noheader"]))),
            ("cuDNN version", _probe(lambda: torch.backends.cudnn.version())),
        ]
    else:
        gpu += [("CUDA runtime version", "No CUDA"), ("GPU models and configuration", "No CUDA"),
                ("Nvidia driver version", "No CUDA"), ("cuDNN version", "No CUDA")]
    mps = getattr(torch.backends, "mps", None)
    if sys.platform == "darwin" and mps is not None:
        gpu.append(("Is MPS available", _probe(lambda: mps.is_available())))
    return ("PyTorch Info", pytorch), ("CUDA / GPU Info", gpu)


def _package_version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _pagedllm_version() -> str:
    import pagedllm

    return f"{pagedllm.__version__} ({os.path.dirname(os.path.abspath(pagedllm.__file__))})"


def is_secret(name: str) -> bool:
    """Whether the variable's value is masked in the report (its name holds KEY, TOKEN, SECRET or PASSWORD)."""
    upper = name.upper()
    return any(marker in upper for marker in SECRET_MARKERS)


def relevant_env(environ: Mapping[str, str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(pagedllm's VLLM_* / PAGEDLLM_* variables, the other relevant ones), sorted, secrets masked."""
    def shown(names: list[str]) -> list[tuple[str, str]]:
        return [(n, MASK if is_secret(n) else environ[n]) for n in sorted(names)]

    own = [n for n in environ if n.startswith(ENV_PREFIXES)]
    others = [n for n in environ if n.startswith(OTHER_ENV_PREFIXES) or n in OTHER_ENV_NAMES]
    return shown(own), shown(others)


def collect_env_info(environ: Mapping[str, str] | None = None) -> list[Section]:
    """The report's sections: (title, [(label, value), ...])."""
    environ = os.environ if environ is None else environ
    system = [
        ("OS", _probe(_os_name)),
        ("Libc version", _probe(lambda: "-".join(p for p in platform.libc_ver() if p))),
        ("C compiler (CPU kernels)", _probe(_c_compiler)),
    ]
    python = [
        ("Python version", f"{sys.version.replace(chr(10), ' ')} ({sys.maxsize.bit_length() + 1}-bit runtime)"),
        ("Python platform", _probe(platform.platform)),
        ("Python executable", sys.executable),
    ]
    cpu = [
        ("CPU", _probe(_cpu_model)),
        ("Architecture", platform.machine() or NOT_COLLECTED),
        ("CPU count", _probe(_cpu_count)),
        ("pagedllm CPU ISA", _probe(_cpu_isa)),
    ]
    packages = [(label, _package_version(dist)) for label, dist in RELEVANT_PACKAGES]
    packages.append(("pagedllm", _probe(_pagedllm_version)))
    own, others = relevant_env(environ)
    pytorch, gpu = _torch_sections()
    return [
        ("System Info", system),
        pytorch,
        ("Python Environment", python),
        gpu,
        ("CPU Info", cpu),
        ("Versions of relevant libraries", packages),
        ("pagedllm environment variables", own or [("(none set)", "")]),
        ("Other relevant environment variables", others or [("(none set)", "")]),
    ]


def format_report(sections: list[Section]) -> str:
    """vLLM's layout: a banner per section, then ``label : value`` lines with the colons aligned."""
    width = max(len(label) for _, rows in sections for label, _ in rows)
    bar = "=" * 40
    out: list[str] = []
    for title, rows in sections:
        out += [bar, title.center(len(bar)).rstrip(), bar]
        for label, value in rows:
            out.append(f"{label:<{width}} : {value}" if value else label)
        out.append("")
    return "\n".join(out)


def add_collect_env_parser(sub) -> None:
    """Register `collect-env`."""
    desc = "Print the environment (OS, Python, torch, GPUs, CPU and its ISA, packages, variables) for bug reports."
    p = sub.add_parser("collect-env", help=desc, description=desc)
    p.set_defaults(func=run_collect_env)


def run_collect_env(args: argparse.Namespace | None = None) -> int:
    """Print the report on stdout."""
    print("Collecting environment information...", file=sys.stderr)
    print(format_report(collect_env_info()))
    return 0


if __name__ == "__main__":
    sys.exit(run_collect_env())
