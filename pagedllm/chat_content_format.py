"""vLLM's chat-template content formats: how a message's ``content`` reaches the Jinja template.

"string": the content is one string (a list of text parts joined with "\\n", as vLLM joins them); "openai": the
content is OpenAI's list of parts (``[{"type": "text", "text": ...}]``, a plain string wrapped as one part); "auto":
"openai" when the template loops over a message's content (found by walking its Jinja syntax tree, as vLLM does),
else "string".
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Iterator, Literal

ContentFormat = Literal["string", "openai"]
#: The values of --chat-template-content-format (and LLM.chat's chat_template_content_format).
CONTENT_FORMAT_OPTIONS = ("auto", "string", "openai")

logger = logging.getLogger(__name__)


def check_content_format_option(option: str) -> None:
    """A ValueError naming the allowed values for anything but auto, string or openai."""
    if option not in CONTENT_FORMAT_OPTIONS:
        raise ValueError(f"chat_template_content_format must be one of {list(CONTENT_FORMAT_OPTIONS)}, got "
                         f"{option!r}.")


def template_text(tokenizer: Any, chat_template: str | None = None, tools: list[dict] | None = None) -> str | None:
    """The template text a render uses: `chat_template`, else the tokenizer's own (a named one picked as
    transformers picks it, e.g. "tool_use" with tools); None when there is none."""
    if chat_template is not None:
        return chat_template
    try:
        return tokenizer.get_chat_template(None, tools=tools)
    except Exception:  # no template, or a tokenizer without get_chat_template
        own = getattr(tokenizer, "chat_template", None)
        return own if isinstance(own, str) else None


def resolve_content_format(option: str, template: str | None) -> ContentFormat:
    """The format a render uses: `option` itself, or for "auto" the one `template` calls for."""
    check_content_format_option(option)
    if option == "auto":
        return detect_content_format(template)
    return option  # type: ignore[return-value]


@functools.lru_cache(maxsize=64)
def detect_content_format(template: str | None) -> ContentFormat:
    """"openai" when `template` has a ``for`` loop over a message's content (``message['content']``,
    ``message.content``, filtered or sliced, or a variable set from it), else "string" (also for a template that
    does not parse)."""
    if not template:
        return "string"
    ast = _parse(template)
    if ast is None:
        return "string"
    return "openai" if _loops_over_content(ast) else "string"


def _parse(template: str) -> Any:
    """The template's syntax tree, parsed by the environment transformers renders with (its extra tags known);
    None when it does not parse."""
    import jinja2

    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(template).environment
    except Exception:  # an older transformers, or a template it cannot compile
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=[loopcontrols])
    try:
        return env.parse(template)
    except jinja2.TemplateError as e:
        logger.debug("chat template does not parse (%s); content format 'string'", e)
        return None


def _sources(node: Any) -> Iterator[Any]:
    """The variables an expression reads its value from: under filters, tests and slices
    (``x | selectattr(...)``, ``x[1:]``), and both arms of ``a if c else b``."""
    from jinja2 import nodes

    if isinstance(node, nodes.CondExpr):
        yield from _sources(node.expr1)
        if node.expr2 is not None:
            yield from _sources(node.expr2)
        return
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            yield node
            return


def _name(node: Any) -> str | None:
    from jinja2 import nodes

    return node.name if isinstance(node, nodes.Name) else None


def _item_of(node: Any, names: set[str], key: str | None) -> bool:
    """Whether `node` is ``n[key]`` / ``n.key`` for a variable n in `names` (key None: ``n[<int>]``)."""
    from jinja2 import nodes

    if isinstance(node, nodes.Getattr):
        return key is not None and node.attr == key and _name(node.node) in names
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        wanted = node.arg.value == key if key is not None else isinstance(node.arg.value, int)
        return wanted and _name(node.node) in names
    return False


def _loops_over_content(ast: Any) -> bool:
    """Follow ``messages`` through its aliases (``set loop_messages = messages[1:]``) to each message variable
    (``for message in loop_messages``, ``set m = messages[0]``) and its content (``message['content']``, or
    ``set content = message.content``); True when some ``for`` iterates over a content."""
    from jinja2 import nodes

    lists, messages, contents = {"messages"}, set(), set()

    def is_content(expr: Any) -> bool:
        return _name(expr) in contents or _item_of(expr, messages, "content")

    # Assignments may precede or follow their uses in the text (macros, loops): repeat until nothing is added.
    while True:
        before = len(lists) + len(messages) + len(contents)
        for node in ast.find_all((nodes.Assign, nodes.For)):
            target = _name(node.target)
            if target is None:
                continue
            for src in _sources(node.node if isinstance(node, nodes.Assign) else node.iter):
                if _name(src) in lists:
                    (lists if isinstance(node, nodes.Assign) else messages).add(target)
                elif isinstance(node, nodes.Assign) and _item_of(src, lists, None):
                    messages.add(target)
                elif isinstance(node, nodes.Assign) and is_content(src):
                    contents.add(target)
        if len(lists) + len(messages) + len(contents) == before:
            break
    return any(is_content(src) for loop in ast.find_all(nodes.For) for src in _sources(loop.iter))
