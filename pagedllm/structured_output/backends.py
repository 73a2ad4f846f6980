"""Grammar engines behind one small interface: xgrammar (the default, "auto") and llguidance.

A backend turns a `(kind, spec, compact, no_whitespace, close_objects)` key (the manager's `cache_key`: the
request's constraint and the engine's --structured-outputs-config options) into a grammar in two stages:
`build` (fast; parses and validates, raises ValueError naming what is wrong; runs in `add_request`) and
`compile` (slow: the token-mask tables; runs on the manager's thread pool). Matchers are per sequence; `fill_bitmask`
writes one packed int32 row (bit set = token allowed) per matcher into the given rows of a batch-sized
buffer, on one native thread or several, whichever has been cheaper per row (fill_policy).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from pagedllm.structured_output.fill_policy import FillThreadPolicy
from pagedllm.structured_output.grammar_rewrite import fold_bounded_repetitions
from pagedllm.structured_output.params import resolve_backend

logger = logging.getLogger("pagedllm")


def _choice_ebnf(choices: list[str], root: str = "root ::= ") -> str:
    # JSON string literals are valid EBNF/Lark string literals (same escapes).
    return root + " | ".join(json.dumps(c) for c in choices)


class XgrammarBackend:
    """xgrammar: grammars compiled to an adaptive token-mask cache; batch fill on native threads."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], num_threads: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(eos_token_ids))
        self._stop_ids = frozenset(info.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self._batches = {n: xgr.BatchGrammarMatcher(max_threads=n) for n in sorted({1, num_threads})}
        self.fill_policy = FillThreadPolicy(tuple(self._batches))

    def _cheap_mask_form(self, grammar: Any) -> Any:
        """The same language with bounded repetitions folded into their closing literal (grammar_rewrite):
        masks of e.g. ``maxLength`` strings cost µs instead of ms. The grammar as built if the rewrite
        does not parse (it should always)."""
        text = str(grammar)
        folded = fold_bounded_repetitions(text)
        if folded == text:
            return grammar
        try:
            return self._xgr.Grammar.from_ebnf(folded)
        except (RuntimeError, ValueError) as e:
            logger.warning("kept a grammar unfolded: its rewrite did not parse (%s)", _clean(e))
            return grammar

    def build(self, kind: str, spec: str, compact: bool, no_whitespace: bool = False,
              close_objects: bool = False) -> Any:
        """`no_whitespace`: JSON separators ``,`` and ``:`` (compact alone keeps xgrammar's ``, `` and ``: ``).
        `close_objects` changes nothing here: strict mode already closes the objects that list their properties."""
        xgr = self._xgr
        seps = (",", ":") if no_whitespace else None
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(spec, any_whitespace=not compact, separators=seps,
                                                    strict_mode=True)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not compact,
                                                    separators=seps, strict_mode=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(spec)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(_choice_ebnf(json.loads(spec)))
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(spec)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} is invalid: {_clean(e)}") from None
        raise ValueError(f"unknown structured output kind {kind!r}")

    def compile(self, built: Any) -> Any:
        return self._compiler.compile_grammar(self._cheap_mask_form(built))

    def new_matcher(self, compiled: Any) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    @staticmethod
    def accept(matcher: Any, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    @staticmethod
    def is_terminated(matcher: Any) -> bool:
        return matcher.is_terminated()

    def advance(self, matcher: Any, token_id: int) -> int:
        """Accept one token → -1 rejected, 1 the grammar has ended, 0 otherwise (once per constrained row per
        step: an xgrammar matcher ends only by accepting a stop token, so only those ask)."""
        if not matcher.accept_token(token_id):
            return -1
        return 1 if token_id in self._stop_ids and matcher.is_terminated() else 0

    def try_advance(self, matcher: Any, token_id: int) -> int:
        """`advance`, except that a rejected token leaves the matcher as it was (xgrammar's accept does)."""
        return self.advance(matcher, token_id)

    @staticmethod
    def rollback(matcher: Any, num_tokens: int) -> None:
        if num_tokens:
            matcher.rollback(num_tokens)

    @staticmethod
    def fill_row(matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    @staticmethod
    def forced_tokens(matcher: Any) -> list[int]:
        """The continuation the grammar forces, tokenized greedily (xgrammar's jump-forward tokens)."""
        return matcher.find_jump_forward_tokens()

    @staticmethod
    def fork(matcher: Any) -> Any:
        return matcher.fork()

    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
        threads = self.fill_policy.pick()
        t0 = time.perf_counter()
        self._batches[threads].batch_fill_next_token_bitmask(matchers, bitmask, indices=rows)
        self.fill_policy.record(threads, time.perf_counter() - t0, len(rows))


class GuidanceBackend:
    """llguidance: lazy Earley/derivative parser; nothing to precompile beyond the parser itself."""

    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...], num_threads: int) -> None:
        import llguidance
        import llguidance.torch

        self._llg = llguidance
        self._fill = llguidance.torch.fill_next_token_bitmask_par
        self._fill_one = llguidance.torch.fill_next_token_bitmask
        self.vocab_size = vocab_size
        self._tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenBytes(tokenizer, vocab_size, eos_token_ids)),
                                           n_vocab=vocab_size)
        self._executors = {n: llguidance.LLExecutor(num_threads=n) for n in sorted({1, num_threads})}
        self.fill_policy = FillThreadPolicy(tuple(self._executors))

    def build(self, kind: str, spec: str, compact: bool, no_whitespace: bool = False,
              close_objects: bool = False) -> Any:
        """`no_whitespace`: JSON separators ``,`` and ``:`` (llguidance's compact ones); `close_objects`: objects
        with only patternProperties are closed too."""
        M = self._llg.LLMatcher
        opts: dict[str, Any] = {"whitespace_flexible": not (compact or no_whitespace)}
        if no_whitespace:
            opts.update(item_separator=",", key_separator=":")
        try:
            if kind == "json":
                schema = _closed(json.loads(spec), close_pattern_objects=close_objects)
                grammar = M.grammar_from_json_schema(json.dumps(schema), defaults=opts)
            elif kind == "json_object":
                grammar = M.grammar_from_json_schema('{"type": "object"}', defaults=opts)
            elif kind == "regex":
                grammar = M.grammar_from_regex(spec)
            elif kind == "choice":
                grammar = M.grammar_from_lark(_choice_ebnf(json.loads(spec), "start: "))
            elif kind == "grammar":
                from llguidance.gbnf_to_lark import gbnf_to_lark

                try:
                    lark = gbnf_to_lark(spec)
                except Exception as e:  # the converter raises bare Exceptions for undefined rules etc.
                    raise ValueError(str(e)) from None
                grammar = M.grammar_from_lark(lark)
            else:
                raise ValueError(f"unknown structured output kind {kind!r}")
        except (RuntimeError, ValueError, TypeError, KeyError) as e:
            raise ValueError(f"structured_outputs.{kind} is invalid: {_clean(e)}") from None
        is_error, msgs = M.validate_grammar_with_warnings(grammar, self._tok)
        if is_error:
            raise ValueError(f"structured_outputs.{kind} is invalid: {msgs[0] if msgs else 'rejected'}")
        return grammar

    def compile(self, built: Any) -> Any:
        matcher = self._llg.LLMatcher(self._tok, built)
        if matcher.is_error():
            raise ValueError(f"grammar failed to compile: {matcher.get_error()}")
        return matcher  # a template: sequences get deep copies

    @staticmethod
    def new_matcher(compiled: Any) -> Any:
        return compiled.deep_copy()

    @staticmethod
    def accept(matcher: Any, token_id: int) -> bool:
        return matcher.consume_token(token_id) and not matcher.is_error()

    @staticmethod
    def is_terminated(matcher: Any) -> bool:
        return matcher.is_stopped()

    def advance(self, matcher: Any, token_id: int) -> int:
        """Accept one token → -1 rejected, 1 the grammar has ended, 0 otherwise."""
        if not self.accept(matcher, token_id):
            return -1
        return 1 if matcher.is_stopped() else 0

    def try_advance(self, matcher: Any, token_id: int) -> int:
        """`advance`, except that a rejected token leaves the matcher as it was (a consumed one would put it in
        its error state)."""
        if matcher.validate_tokens([token_id]) < 1:
            return -1
        return self.advance(matcher, token_id)

    @staticmethod
    def rollback(matcher: Any, num_tokens: int) -> None:
        if num_tokens:
            matcher.rollback(num_tokens)

    def fill_row(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        self._fill_one(matcher, bitmask, row)

    @staticmethod
    def forced_tokens(matcher: Any) -> list[int]:
        """The continuation the grammar forces, as tokens (llguidance's fast-forward tokens)."""
        return matcher.compute_ff_tokens()

    @staticmethod
    def fork(matcher: Any) -> Any:
        return matcher.deep_copy()

    def fill_bitmask(self, matchers: list[Any], bitmask: torch.Tensor, rows: list[int]) -> None:
        threads = self.fill_policy.pick()
        t0 = time.perf_counter()
        self._fill(self._executors[threads], list(zip(matchers, rows)), bitmask)
        self.fill_policy.record(threads, time.perf_counter() - t0, len(rows))


class _TokenBytes:
    """The tokenizer as llguidance's `TokenizerWrapper` takes it: every token's exact bytes, the EOS and special
    ids, and encoding. The bytes come from xgrammar's decoding of the Hugging Face vocabulary (byte-level,
    byte-fallback or raw). `llguidance.hf.from_tokenizer` instead re-parses the tokenizer's JSON; with the
    bundled GGUF tokenizer under transformers 5.17 its masks let a byte-level newline into JSON strings and
    ended a regex early (BENCHMARKS §25), while the same code under 5.24 was right."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_token_ids))
        self.tokens: list[bytes] = list(info.decoded_vocab)
        self.tokens += [b""] * (vocab_size - len(self.tokens))  # the model's padding rows
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        added = getattr(tokenizer, "added_tokens_decoder", {})  # id → AddedToken
        self.special_token_ids = sorted(set(info.special_token_ids) | set(eos_token_ids)
                                        | set(getattr(tokenizer, "all_special_ids", []))
                                        | {i for i, t in added.items() if getattr(t, "special", False)})
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def _closed(schema: Any, close_pattern_objects: bool = False) -> Any:
    """The schema with ``additionalProperties: false`` wherever an object lists its properties (with
    `close_pattern_objects`, or its patternProperties) and says nothing else, as xgrammar's strict mode does (so both
    backends produce the same outputs' shape)."""
    if isinstance(schema, list):
        return [_closed(s, close_pattern_objects) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v, close_pattern_objects) for k, v in schema.items()}
    listed = "properties" in out or (close_pattern_objects and "patternProperties" in out)
    if listed and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _clean(exc: BaseException) -> str:
    """The engine's message without its C++ source location prefix."""
    text = str(exc).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    first = lines[0] if lines else type(exc).__name__
    if first.startswith("[") and "] " in first:  # "[hh:mm:ss] /project/cpp/x.cc:12: message"
        first = first.split("] ", 1)[1]
        parts = first.split(": ", 1)
        if len(parts) == 2 and ".cc:" in parts[0]:
            first = parts[1]
    return first


def make_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 num_threads: int = 8) -> XgrammarBackend | GuidanceBackend:
    backend = XgrammarBackend if resolve_backend(name) == "xgrammar" else GuidanceBackend
    return backend(tokenizer, vocab_size, eos_token_ids, num_threads)
