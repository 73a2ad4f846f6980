"""Tool parser plugins (``--tool-parser-plugin FILE``, vLLM's flag): a Python file whose `ToolParser` subclasses,
marked with ``@ToolParserManager.register_module(...)``, become ``--tool-call-parser`` names of that server.

Marking only tags the class (its `tool_parser_names`); the loader collects the tagged classes of the loaded file, so
nothing global is mutated and each server holds its own name → parser mapping.
"""
from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.base import ToolParser

#: The class attribute `register_module` sets: the --tool-call-parser names of a plugin's parser.
NAMES_ATTR = "tool_parser_names"


class ToolParserManager:
    """vLLM's decorator for plugin parsers::

        @ToolParserManager.register_module(["my_parser"])
        class MyParser(ToolParser): ...
    """

    @staticmethod
    def register_module(name: str | list[str] | tuple[str, ...] | None = None, force: bool = True,
                        module: type | None = None) -> Any:
        """Mark a ToolParser subclass with its parser names (default: the class's name). As a decorator, or with
        `module` given directly. `force` is accepted for vLLM's signature; a name clashing with a built-in parser is
        refused when the plugin loads."""
        del force
        names = [name] if isinstance(name, str) else list(name) if name is not None else None
        if names is not None and (not names or not all(isinstance(n, str) and n for n in names)):
            raise ValueError(f"register_module: parser names must be non-empty strings, got {name!r}")

        def mark(cls: type) -> type:
            if not isinstance(cls, type) or not issubclass(cls, ToolParser):
                raise TypeError(f"register_module: {cls!r} is not a ToolParser subclass (import ToolParser from "
                                "pagedllm.entrypoints.openai.tool_parsers)")
            setattr(cls, NAMES_ATTR, tuple(names if names is not None else [cls.__name__]))
            return cls

        if module is not None:
            return mark(module)
        return mark


def _marked_names(cls: type) -> tuple[str, ...] | None:
    """A class's own names (a subclass of a registered parser does not inherit them)."""
    return cls.__dict__.get(NAMES_ATTR)


def load_tool_parser_plugin(path: str | Path) -> dict[str, type[ToolParser]]:
    """The parsers a plugin file registers, by name; ValueError for a missing file, a file that fails to import,
    one that registers nothing, a parser without `extract`/`safe_content_end`, or a name given twice."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"--tool-parser-plugin: no such file: {str(path)!r} (expected a Python file defining "
                         "ToolParser subclasses).")
    # A fresh module name per load: two plugins (or one loaded twice) never share a module object.
    module_name = f"pagedllm_tool_parser_plugin_{uuid.uuid4().hex[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin: {str(file)!r} cannot be imported as a Python module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look a class's module up there
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(module_name, None)
        raise ValueError(f"--tool-parser-plugin: importing {str(file)!r} failed: {type(e).__name__}: {e}") from None
    parsers: dict[str, type[ToolParser]] = {}
    for obj in dict.fromkeys(v for v in vars(module).values() if isinstance(v, type)):
        names = _marked_names(obj)
        if not names:
            continue
        missing = [m for m in ("extract", "safe_content_end") if getattr(obj, m) is getattr(ToolParser, m)]
        if missing:
            raise ValueError(f"--tool-parser-plugin: {obj.__name__} in {str(file)!r} does not define "
                             f"{' and '.join(missing)} (a ToolParser needs extract(text) and "
                             "safe_content_end(text)).")
        for n in names:
            if n in parsers and parsers[n] is not obj:
                raise ValueError(f"--tool-parser-plugin: the parser name {n!r} is registered twice in "
                                 f"{str(file)!r} ({parsers[n].__name__} and {obj.__name__}).")
            parsers[n] = obj
    if not parsers:
        raise ValueError(f"--tool-parser-plugin: {str(file)!r} registers no tool parser; decorate a ToolParser "
                         "subclass with @ToolParserManager.register_module([\"name\"]) (both from "
                         "pagedllm.entrypoints.openai.tool_parsers).")
    return parsers


__all__ = ["ToolParserManager", "load_tool_parser_plugin"]
