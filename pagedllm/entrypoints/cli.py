"""`pagedllm generate | serve | run-batch | bench | chat | complete | collect-env` — the command line."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from pagedllm.entrypoints.config_file import FlexibleArgumentParser, add_config_arg

# Clients of a running server and the environment report: parsed without the engine's modules (torch through
# EngineArgs, fastapi through serve), so they start at once.
CLIENT_COMMANDS = ("chat", "complete", "collect-env")


def _add_generate(sub) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = sub.add_parser("generate", help="Generate completions for one or more prompts.",
                       description="Generate completions offline with the paged engine.")
    p.add_argument("--prompt", action="append", default=None,
                   help="A prompt (repeatable). Default: 'What is the capital of France?'")
    p.add_argument("--max-tokens", type=int, default=64, help="Tokens to generate per prompt (default: 64).")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 = greedy (default: 0).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling probability mass (default: 1.0).")
    p.add_argument("--top-k", type=int, default=0, help="Keep the k most likely tokens; 0 = all (default: 0).")
    p.add_argument("--n", type=int, default=1, help="Completions per prompt (default: 1).")
    p.add_argument("--sampling-seed", type=int, default=None, help="Seed for this request's sampling.")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="Wrap each prompt as a user message in the model's chat template (default: on).")
    p.add_argument("--json", action="store_true", help="Print one JSON object per output instead of text.")
    add_config_arg(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs

    prompts = args.prompt or ["What is the capital of France?"]
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed)
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    if args.chat and llm.get_tokenizer() is not None and llm.get_tokenizer().chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=not args.json)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=not args.json)
    for prompt, out in zip(prompts, outputs):
        for comp in out.outputs:
            if args.json:
                print(json.dumps({"prompt": prompt, "index": comp.index, "text": comp.text,
                                  "token_ids": comp.token_ids, "finish_reason": comp.finish_reason,
                                  "num_prompt_tokens": len(out.prompt_token_ids)}))
            else:
                print(f"Prompt: {prompt!r}\nOutput[{comp.index}] ({comp.finish_reason}): {comp.text}\n")
    return 0


def build_parser(clients_only: bool = False) -> argparse.ArgumentParser:
    """The whole command line; `clients_only`: only CLIENT_COMMANDS (no engine module imported)."""
    from pagedllm.entrypoints import cli_clients, collect_env

    parser = FlexibleArgumentParser(prog="pagedllm", description="pagedllm: a PagedAttention LLM serving engine.")
    parser.add_argument("--log-level", default="INFO", help="Logging level (default: INFO).")
    sub = parser.add_subparsers(dest="command", required=True)
    if not clients_only:
        _add_generate(sub)
        from pagedllm.entrypoints import bench_cli

        bench_cli.add_bench_parser(sub)
    cli_clients.add_client_parsers(sub)
    collect_env.add_collect_env_parser(sub)
    if clients_only:
        return parser
    try:
        from pagedllm.entrypoints.openai import cli_serve
    except ImportError:
        cli_serve = None
    if cli_serve is not None:
        from pagedllm.entrypoints.openai import run_batch

        cli_serve.add_serve_parser(sub)
        run_batch.add_run_batch_parser(sub)
    return parser


def _command_of(argv: list[str]) -> str | None:
    """The subcommand `argv` names: its first word that is not an option (or --log-level's value)."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(clients_only=_command_of(argv) in CLIENT_COMMANDS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
