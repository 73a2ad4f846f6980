"""vLLM's command-line conveniences for `pagedllm`: `--config FILE.yaml` and `--flag_name` for `--flag-name`.

A subcommand that registers `--config` (`add_config_arg`) reads its flags from that YAML file: each key is a long
flag name (with `-` or `_`), each value as on the command line (true / false for a switch, a list for a flag that
takes several values, a mapping for a JSON-valued flag). Flags given on the command line win over the file, the
file wins over the defaults, as in vLLM.
"""
from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Sequence

CONFIG_FLAG = "--config"
CONFIG_SUFFIXES = (".yaml", ".yml")


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    """Register vLLM's `--config FILE.yaml` on a subcommand's parser."""
    parser.add_argument(CONFIG_FLAG, metavar="FILE.yaml", default=None,
                        help="vLLM's config file: a YAML mapping of this command's long flag names (with - or _) "
                             "to values as on the command line (true/false for a switch, a list for a flag of "
                             "several values, a mapping for a JSON flag); flags on the command line win.")


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that takes `--flag_name` for `--flag-name` and, where `--config` is registered, reads
    flags from that YAML file before the command line's (subparsers made by `add_subparsers` are of this class
    too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._config_source: str | None = None  # the file being read, named in errors while it is

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        args = dashed_flags(list(sys.argv[1:] if args is None else args))
        paths = config_paths(args) if CONFIG_FLAG in self._option_string_actions else []
        if not paths:
            return super().parse_known_args(args, namespace)
        if len(paths) > 1:
            self.error(f"{CONFIG_FLAG} was given {len(paths)} times ({', '.join(paths)}); give one file.")
        try:
            from_file = config_file_args(self, paths[0])
        except ValueError as e:
            self.error(str(e))
        self._config_source = paths[0]
        try:
            base, extra = super().parse_known_args(from_file, namespace)
        finally:
            self._config_source = None
        if extra:
            self.error(f"{CONFIG_FLAG} {paths[0]}: could not use {' '.join(extra)}")
        # The command line parses onto the file's values: what it gives replaces them, the rest stays.
        return super().parse_known_args(args, base)

    def error(self, message: str):
        if self._config_source is not None:
            message = f"{message} (in {CONFIG_FLAG} {self._config_source})"
        super().error(message)


def dashed_flags(args: list[str]) -> list[str]:
    """`--max_model_len=5` → `--max-model-len=5` (vLLM accepts both spellings); values and arguments after a
    bare `--` are left alone."""
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + args[i:]
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


def config_paths(args: list[str]) -> list[str]:
    """The `--config` values on a command line (argparse itself reports a `--config` without one)."""
    paths = []
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg == CONFIG_FLAG and i + 1 < len(args):
            paths.append(args[i + 1])
        elif arg.startswith(CONFIG_FLAG + "="):
            paths.append(arg.partition("=")[2])
    return paths


def load_config_file(path: str) -> dict[str, Any]:
    """The YAML mapping in `path`; ValueError naming the file for anything else."""
    import yaml

    if Path(path).suffix.lower() not in CONFIG_SUFFIXES:
        raise ValueError(f"{CONFIG_FLAG} {path}: a config file is YAML, named *.yaml or *.yml.")
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"{CONFIG_FLAG} {path}: cannot read it: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{CONFIG_FLAG} {path}: not valid YAML: {_yaml_problem(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_FLAG} {path}: expected a mapping of flag names to values "
                         f"(e.g. 'max-model-len: 4096'), got a YAML {type(data).__name__}.")
    return data


def _yaml_problem(error: Exception) -> str:
    """A YAML error in one line: what is wrong and where."""
    problem, mark = getattr(error, "problem", None), getattr(error, "problem_mark", None)
    if problem is None or mark is None:
        return " ".join(str(error).split())
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"


def config_file_args(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The command-line arguments `path`'s keys and values stand for, each key checked against `parser`'s
    flags; ValueError naming the file and the key (an unknown key: with the allowed keys) for a bad entry."""
    args: list[str] = []
    for key, value in load_config_file(path).items():
        found = _flag_for(parser, key)
        if found is None:
            name = str(key).replace("_", "-")
            allowed = _allowed_keys(parser)
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{CONFIG_FLAG} {path}: unknown key {key!r}: `{parser.prog}` has no --{name} flag."
                             f"{hint} Allowed keys (with - or _): {', '.join(allowed)}.")
        try:
            args += _flag_args(*found, value)
        except ValueError as e:
            raise ValueError(f"{CONFIG_FLAG} {path}: key {key!r}: {e}") from None
    return args


def _long_flags(action: argparse.Action) -> list[str]:
    """The long flags a config key may name for `action` (a --x / --no-x switch: both)."""
    return [opt for opt in action.option_strings if opt.startswith("--") and opt not in ("--help", CONFIG_FLAG)]


def _allowed_keys(parser: argparse.ArgumentParser) -> list[str]:
    return sorted({flag[2:] for a in parser._actions for flag in _long_flags(a)[:1]})


def _flag_for(parser: argparse.ArgumentParser, key: Any) -> tuple[str, argparse.Action] | None:
    """(the flag, its action) a config key names; None: no such flag, or one a file cannot set."""
    if not isinstance(key, str):
        return None
    flag = "--" + key.replace("_", "-")
    action = parser._option_string_actions.get(flag)
    return (flag, action) if action is not None and flag in _long_flags(action) else None


def _scalar(value: Any) -> str:
    if isinstance(value, (dict, list, bool)):
        return json.dumps(value)
    return str(value)


def _flag_args(flag: str, action: argparse.Action, value: Any) -> list[str]:
    """One config entry as command-line arguments, shaped by the flag's action."""
    if value is None:  # `key:` or `key: null`: the flag's default
        return []
    if action.nargs == 0:  # a switch: store_true, store_false, --x / --no-x
        if not isinstance(value, bool):
            raise ValueError(f"{flag} is a switch: give true or false, got {value!r}.")
        if value:
            return [flag]
        opposite = [opt for opt in _long_flags(action) if opt != flag]
        return opposite[:1] if isinstance(action, argparse.BooleanOptionalAction) else []
    if action.nargs == "?" and value is True:  # a flag whose value is optional (--hf-token)
        return [flag]
    if isinstance(action, argparse._AppendAction):
        return [f"{flag}={_scalar(v)}" for v in (value if isinstance(value, list) else [value])]
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        items = value if isinstance(value, list) else [value]
        return [flag, *(_scalar(v) for v in items)]
    # One value: `--flag=value`, so a value that starts with '-' is not read as a flag.
    return [f"{flag}={_scalar(value)}"]
