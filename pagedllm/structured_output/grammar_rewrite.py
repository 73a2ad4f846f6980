"""Rewrites of xgrammar's EBNF that keep the language and make the per-step token mask cheap.

xgrammar precomputes, per grammar position, which tokens are accepted or rejected whatever the context;
only the rest ("uncertain" tokens) are checked at every step. A bounded repetition followed by a literal,
``chars{0, 12} "\\""`` (how a JSON string with ``maxLength`` compiles), ends the repetition's rule at the
bound: near it, every token longer than the remaining count leaves the rule and is uncertain, so a step
checks ~30 000 tokens one by one (2-5 ms per row on this vocabulary, BENCHMARKS §31). Folding the
literal into an unrolled chain, ``q_k ::= "\\"" | chars q_(k-1)`` and ``q_0 ::= "\\""``, keeps the same
strings but lets each rule reject an overlong token itself: fills fall to a few µs per row.
"""
from __future__ import annotations

import re

#: Repetitions bounded above this keep xgrammar's form (one rule per count: rules and compile time grow with it).
MAX_UNROLL = 256

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_LITERAL = r'"(?:[^"\\]|\\.)*"'
# `name{lo, hi} "literal"` inside one sequence (hi = -1 means unbounded and is left alone).
_BOUNDED_THEN_LITERAL = re.compile(rf"(?<![A-Za-z0-9_])({_NAME})\{{(\d+), (\d+)\}} ({_LITERAL})")
_RULE_HEAD = re.compile(rf"^({_NAME}) ::= ", re.MULTILINE)


def fold_bounded_repetitions(ebnf: str, max_unroll: int = MAX_UNROLL) -> str:
    """``ebnf`` with each ``item{lo, hi} "lit"`` (``hi`` ≤ ``max_unroll``) replaced by an unrolled chain
    of rules that ends in the literal; the same language. Unchanged text when there is nothing to fold."""
    taken = set(_RULE_HEAD.findall(ebnf))
    prefixes: dict[tuple[str, str], str] = {}
    new_rules: dict[str, str] = {}

    def rule_name(prefix: str, lo: int, hi: int) -> str:
        name = f"{prefix}_{lo}_{hi}"
        while name in taken:  # never shadow one of the grammar's own rules
            name += "_"
        return name

    def chain(item: str, lo: int, hi: int, literal: str) -> str:
        prefix = prefixes.setdefault((item, literal), f"{item}_then{len(prefixes)}")
        states = [(lo, hi)]  # (items still required, items still allowed), down to (0, 0)
        while states[-1] != (0, 0):
            a, b = states[-1]
            states.append((a - 1, b - 1) if a > 0 else (0, b - 1))
        following: str | None = None  # built from (0, 0) upwards: each rule refers to the next one down
        for a, b in reversed(states):
            name = rule_name(prefix, a, b)
            if name not in new_rules:
                if a > 0:
                    new_rules[name] = f"({item} {following})"
                elif b == 0:
                    new_rules[name] = f"({literal})"
                else:
                    new_rules[name] = f"({literal}) | ({item} {following})"
            following = name
        return following  # type: ignore[return-value]

    code, literal_starts = _outside_literals(ebnf)

    def replace(m: re.Match) -> str:
        item, lo, hi, literal = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        if hi < lo or hi > max_unroll or not code[m.start()] or m.start(4) not in literal_starts:
            return m.group(0)  # too long to unroll, or text inside a literal / character class
        return chain(item, lo, hi, literal)

    folded = _BOUNDED_THEN_LITERAL.sub(replace, ebnf)
    if not new_rules:
        return ebnf
    return folded.rstrip("\n") + "\n" + "".join(f"{k} ::= {v}\n" for k, v in new_rules.items())


def _outside_literals(ebnf: str) -> tuple[list[bool], set[int]]:
    """Per character: is it grammar code (not inside a quoted literal or a character class)? And the
    positions of the quotes that open literals."""
    code = [True] * len(ebnf)
    starts: set[int] = set()
    i, n = 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c in "\"[":
            close = "\"" if c == "\"" else "]"
            if c == "\"":
                starts.add(i)
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            for k in range(i + 1, min(j, n)):
                code[k] = False
            i = j + 1
        else:
            i += 1
    return code, starts
