"""The frozen input-copying prompts of the speculation benchmark (issue 20's workload)."""
import pytest

from pagedllm.benchmarks.copy_prompts import KINDS, draw_copy_texts, load_copy_texts, make_copy_prompts


def test_frozen_prompts_are_the_issues_hundred_in_turn():
    prompts = load_copy_texts(100)
    assert len(prompts) == 100
    assert [p["kind"] for p in prompts] == [KINDS[i % 3] for i in range(100)]
    for p in prompts:
        body = p["text"].split("\n\n", 1)[1]
        assert len(body) > 100, p["source"]
        if p["kind"] == "rename":
            name = p["text"].split("`")[1]
            assert f"def {name}(" in body, p["source"]
    # the summaries draw README passages with replacement, so a few repeat; the code windows do not
    assert len({p["text"] for p in prompts if p["kind"] != "summarize"}) == 67


def test_frozen_prompts_refuse_more_than_they_hold():
    assert len(load_copy_texts(7)) == 7
    with pytest.raises(ValueError, match="holds 100 prompts; asked for 101"):
        load_copy_texts(101)


def test_a_fresh_draw_has_the_same_shape():
    drawn = draw_copy_texts(9, seed=3)
    assert [p["kind"] for p in drawn] == [KINDS[i % 3] for i in range(9)]
    assert all(p["source"] and p["text"] for p in drawn)


def test_make_copy_prompts_templates_the_frozen_texts(tokenizer):
    ids = make_copy_prompts(tokenizer, 3)
    text = tokenizer.decode(ids[0])
    assert load_copy_texts(1)[0]["text"] in text and "user" in text
    with pytest.raises(ValueError, match="'frozen' or 'draw'"):
        make_copy_prompts(tokenizer, 3, source="tree")
