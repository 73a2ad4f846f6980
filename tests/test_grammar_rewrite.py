"""The grammar rewrite behind cheap masks: bounded repetitions folded into their closing literal keep the
language, so every step's token mask is bit for bit xgrammar's own, on the bundled model's tokenizer."""
from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")
torch = pytest.importorskip("torch")

from pagedllm.structured_output.grammar_rewrite import MAX_UNROLL, fold_bounded_repetitions  # noqa: E402
from pagedllm.structured_output.sample_schemas import SCHEMAS  # noqa: E402


def test_fold_unrolls_into_the_literal():
    text = 'root ::= ((root_1{1, 3} "!"))\nroot_1 ::= (([a-z]))\n'
    folded = fold_bounded_repetitions(text)
    rules = dict(line.split(" ::= ", 1) for line in folded.strip().splitlines())
    assert rules["root"] == "((root_1_then0_1_3))"
    assert rules["root_1_then0_1_3"] == "(root_1 root_1_then0_0_2)"  # the one required item
    assert rules["root_1_then0_0_2"] == '("!") | (root_1 root_1_then0_0_1)'
    assert rules["root_1_then0_0_0"] == '("!")'
    assert set(rules) == {"root", "root_1", "root_1_then0_1_3", "root_1_then0_0_2", "root_1_then0_0_1",
                          "root_1_then0_0_0"}


@pytest.mark.parametrize("text", [
    'root ::= ((root_1{0, -1} "!"))\nroot_1 ::= (([a-z]))\n',  # unbounded
    f'root ::= ((root_1{{0, {MAX_UNROLL + 1}}} "!"))\nroot_1 ::= (([a-z]))\n',  # too long to unroll
    'root ::= ((root_1{4, 4} [0-9]))\nroot_1 ::= (([a-z]))\n',  # no literal after it
    'root ::= (("x{0, 3} " "y"))\n',  # inside a literal
    'root ::= (([a{0, 3} "] "y"))\n',  # inside a character class
])
def test_fold_leaves_other_text_alone(text):
    assert fold_bounded_repetitions(text) == text


def test_fold_never_shadows_an_existing_rule():
    text = 'root ::= ((a{0, 1} "!"))\na ::= (("a"))\na_then0_0_0 ::= (("z"))\n'
    folded = fold_bounded_repetitions(text)
    assert 'a_then0_0_0 ::= (("z"))' in folded and "a_then0_0_0_ ::= " in folded


@pytest.fixture(scope="module")
def compiler(tokenizer):
    vocab = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False), vocab


CASES = [("json", json.dumps(s)) for s in SCHEMAS] + [
    ("json", json.dumps({"type": "object", "properties": {"é\"x": {"type": "string", "minLength": 2, "maxLength": 5},
                                                          "b": {"enum": ["a\"b", "ü"]}}, "required": ["é\"x", "b"]})),
    ("regex", r"[a-z]{0,12}!"),
    ("regex", r".{2,20}\."),
    ("regex", r"(\+33|0)[1-9]( \d\d){4}"),
]


@pytest.mark.parametrize("kind,spec", CASES, ids=[f"{k}{i}" for i, (k, _) in enumerate(CASES)])
def test_folded_grammar_gives_identical_masks(compiler, kind, spec):
    """Random walks through the grammar (each step picks a random allowed token): the folded grammar's
    bitmask equals the original's at every step, and the walk ends in the same place."""
    comp, vocab = compiler
    original = (xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True) if kind == "json"
                else xgr.Grammar.from_regex(spec))
    folded_text = fold_bounded_repetitions(str(original))
    if kind == "json" and "maxLength" in spec or kind == "regex" and "{0,12}" in spec:
        assert folded_text != str(original)  # these cases do exercise the rewrite
    grammars = [comp.compile_grammar(original), comp.compile_grammar(xgr.Grammar.from_ebnf(folded_text))]
    shifts = torch.arange(32, dtype=torch.int32)
    gen = torch.Generator().manual_seed(len(spec))
    for _ in range(4):
        matchers = [xgr.GrammarMatcher(g) for g in grammars]
        masks = [xgr.allocate_token_bitmask(1, vocab) for _ in matchers]
        for _step in range(48):
            assert matchers[0].is_terminated() == matchers[1].is_terminated()
            if matchers[0].is_terminated():
                break
            for m, bm in zip(matchers, masks):
                m.fill_next_token_bitmask(bm, 0)
            assert torch.equal(masks[0], masks[1])
            allowed = ((masks[0][0].unsqueeze(1) >> shifts) & 1).reshape(-1)[:vocab].nonzero().flatten()
            token = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
            assert all(m.accept_token(token) for m in matchers)


def test_engine_backend_uses_the_folded_grammar(tokenizer):
    from pagedllm.structured_output.backends import XgrammarBackend

    backend = XgrammarBackend(tokenizer, len(tokenizer), (tokenizer.eos_token_id,), num_threads=1)
    built = backend.build("json", json.dumps(SCHEMAS[0]), True)  # validation only, on the request's thread
    assert "{0, 12}" in str(built)
    compiled = backend.compile(built)  # on the compile thread: the folded form
    assert "{0, 12}" not in str(compiled.grammar) and "_then0_0_12" in str(compiled.grammar)
