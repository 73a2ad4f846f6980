"""CompileWatch hears real Triton builds: kernels compiled for sm_90 on this CPU (triton_compile_only), in a
subprocess without TRITON_INTERPRET (the interpreter builds nothing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import triton_setup  # noqa: F401  (before Triton: TRITON_INTERPRET on CPU for the other kernel tests)

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, logging, sys
    import torch
    from triton import knobs
    from pagedllm.kernels.compile_watch import CompileWatch, watchers_paused
    from pagedllm.kernels.triton_compile_only import compile_only, hooks_present
    from pagedllm.kernels import triton_attention

    if not hooks_present():
        sys.exit(3)
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("pagedllm").addHandler(handler)
    earlier = []  # a hook someone installed before: the watch must keep calling it
    knobs.runtime.jit_cache_hook = lambda **kw: earlier.append(kw["fn"].name) or False
    kc = torch.zeros(12, 16, 2, 64, dtype=torch.bfloat16)
    tables = torch.zeros(3, 4, dtype=torch.int32)
    lens = torch.tensor([10, 40, 60], dtype=torch.int32)
    q = torch.zeros(3, 8, 64, dtype=torch.bfloat16)

    def decode(splits):
        triton_attention.paged_decode_attention(q, kc, kc, tables, lens, 0.1, 60, num_splits=splits)

    watch = CompileWatch()
    with compile_only(90):
        decode(1)  # before the watch: the warm start
        installed = watch.install()
        decode(1)  # already built: nothing to hear
        after_warm = len(watch.events)
        decode(4)  # a split count the warm start did not run: new binaries
        heard = [e.kernel for e in watch.events]
        with watchers_paused():  # another engine's warm start in this process: not this engine's steps
            decode(8)
        paused_heard = len(watch.events) - len(heard)
        back_after_pause = knobs.runtime.jit_cache_hook == watch._hook
        watch.uninstall()
        restored = knobs.runtime.jit_cache_hook is not None and knobs.runtime.jit_cache_hook != watch._hook
        decode(16)
    print(json.dumps({"installed": installed, "after_warm": after_warm, "heard": heard, "paused_heard": paused_heard,
                      "back_after_pause": back_after_pause,
                      "after_uninstall": len(watch.events), "restored": restored, "earlier": earlier,
                      "warnings": warnings}))
""")


def test_compile_watch_hears_builds_after_the_warm_start_only():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(Path(os.environ.get("TMPDIR", "/tmp")) / "pagedllm-compile-watch-test")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if done.returncode == 3:
        pytest.skip("this Triton has no compile-only hooks")
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["installed"] is True
    assert got["after_warm"] == 0
    assert got["heard"] and all(k.startswith("pagedllm.kernels.triton_attention.") for k in got["heard"]), got
    assert got["paused_heard"] == 0 and got["back_after_pause"]  # builds under watchers_paused go unreported
    assert got["after_uninstall"] == len(got["heard"])  # uninstalled: the 16-split build went unheard
    assert got["restored"]
    # the earlier hook saw every build: the warm start's, the watched ones and the one after
    assert len(got["earlier"]) > len(got["heard"])
    assert len(got["warnings"]) == len(got["heard"])
    assert all("compiled after the warm start" in w for w in got["warnings"])
