"""The input-copying prompts of issue 20's speculation benchmark, frozen in `data/copy_prompts.json`.

Three kinds in turn, drawn once from this repository's own text (and ../shared's ARCHITECTURE.md where present):
(1) "repeat this code exactly" over a 12-30 line window of a pagedllm/*.py file, (2) "rename function X to
X_v2 and output the whole code" over a window that defines a function, (3) "summarize this text quoting its
key sentences verbatim" over a README.md / ARCHITECTURE.md passage.

Drawing them from the tree at run time made them change with every commit that edited a `.py` file or the
README, and with the checkout's location, so runs on different trees measured different prompts. The frozen
file holds one draw; `python -m pagedllm.benchmarks.copy_prompts --write` draws again (from the present tree)
and rewrites it.
"""
from __future__ import annotations

import argparse
import json
import random
import subprocess
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
FROZEN_PATH = Path(__file__).resolve().parent / "data" / "copy_prompts.json"
KINDS = ("copy", "rename", "summarize")


def _code_windows(rng: random.Random, n: int, need_def: bool) -> list[dict]:
    files = sorted((_ROOT / "pagedllm").rglob("*.py"))
    out: list[dict] = []
    while len(out) < n:
        path = rng.choice(files)
        lines = path.read_text().splitlines()
        if len(lines) < 40:
            continue
        size = rng.randint(12, 30)
        start = rng.randrange(0, len(lines) - size)
        window = lines[start:start + size]
        name = next((ln.split("def ", 1)[1].split("(")[0] for ln in window if ln.lstrip().startswith("def ")), None)
        if need_def and name is None:
            continue
        out.append({"code": "\n".join(window), "name": name,
                    "source": f"{path.relative_to(_ROOT)}:{start + 1}-{start + size}"})
    return out


def _doc_passages(rng: random.Random, n: int) -> list[dict]:
    paras = []
    for name in ("README.md", "ARCHITECTURE.md"):
        for path in (_ROOT / name, _ROOT.parent / "shared" / name):
            if path.exists():
                source = "../shared/" + name if path.parent.name == "shared" else name
                paras += [(p, source) for p in path.read_text().split("\n\n") if 300 < len(p) < 1500]
    return [dict(zip(("text", "source"), rng.choice(paras))) for _ in range(n)] if paras else []


def draw_copy_texts(num: int, seed: int = 0) -> list[dict]:
    """Draw `num` prompts from the present tree: [{"kind", "source", "text"}], the kinds in turn."""
    rng = random.Random(seed)
    per = num // 3 + 1
    copies = _code_windows(rng, per, need_def=False)
    edits = _code_windows(rng, per, need_def=True)
    docs = _doc_passages(rng, per)
    out = []
    for i in range(num):
        kind, j = i % 3, i // 3
        if kind == 0 or (kind == 2 and not docs):
            w = copies[j]
            out.append({"kind": "copy", "source": w["source"],
                        "text": f"Repeat the following code exactly, with nothing else.\n\n{w['code']}"})
        elif kind == 1:
            w = edits[j]
            out.append({"kind": "rename", "source": w["source"],
                        "text": f"Rename the function `{w['name']}` to `{w['name']}_v2` in this code and output "
                                f"the whole updated code.\n\n{w['code']}"})
        else:
            d = docs[j]
            out.append({"kind": "summarize", "source": d["source"],
                        "text": f"Summarize this text, quoting its key sentences verbatim.\n\n{d['text']}"})
    return out


def load_copy_texts(num: int) -> list[dict]:
    """The first `num` frozen prompts."""
    prompts = json.loads(FROZEN_PATH.read_text())["prompts"]
    if not 0 <= num <= len(prompts):
        raise ValueError(f"the frozen copy workload holds {len(prompts)} prompts; asked for {num} "
                         f"(use --copy-prompts draw for a larger set drawn from this tree)")
    return prompts[:num]


def make_copy_prompts(tokenizer, num: int, seed: int = 0, source: str = "frozen") -> list[list[int]]:
    """`num` input-copying prompts as chat-templated token ids. source "frozen": the file's (seed unused);
    "draw": drawn from the present tree with `seed`."""
    if source not in ("frozen", "draw"):
        raise ValueError(f"copy prompt source must be 'frozen' or 'draw', got {source!r}")
    texts = load_copy_texts(num) if source == "frozen" else draw_copy_texts(num, seed)
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t["text"]}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    return [tokenizer.encode(c, add_special_tokens=False) for c in chats]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="draw from the present tree and rewrite the frozen file")
    p.add_argument("--num", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    texts = draw_copy_texts(a.num, a.seed)
    if not a.write:
        print(json.dumps(texts[:3], indent=1))
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_ROOT, capture_output=True,
                            text=True).stdout.strip()
    FROZEN_PATH.write_text(json.dumps({"drawn_from_commit": commit, "seed": a.seed, "kinds": list(KINDS),
                                       "prompts": texts}, indent=1) + "\n")
    print(f"wrote {len(texts)} prompts to {FROZEN_PATH}")


if __name__ == "__main__":
    main()
