"""Prompt rendering with a word-level fake tokenizer."""
from __future__ import annotations

import json

import pytest

from batchgen.pipeline import render
from batchgen.pipeline.render import PromptRenderer, RenderError, check_template, required_columns, truncate


class WordTokenizer:
    """One id per whitespace-separated word; chat turns are marked with ids 1 (role start) and 2 (end)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.vocab) + 10
                self.words[self.vocab[w]] = w
            ids.append(self.vocab[w])
        return ids

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += [1, *self.encode(m["role"]), *self.encode(m["content"]), 2]
        return ids + ([1, *self.encode("assistant")] if add_generation_prompt else [])

    def decode(self, ids) -> str:
        return " ".join(self.words.get(i, f"<{i}>") for i in ids)


def renderer(template: str = "Summarize: {{ text }}", system: str | None = None, chat: bool = False):
    return PromptRenderer(template, system, chat, WordTokenizer())


def test_required_columns():
    assert required_columns("{{ title }}\n\n{{ text | upper }}") == {"title", "text"}
    assert required_columns("{% set n = 2 %}{% for p in people %}{{ p.name }}{{ loop.index }}{% endfor %}"
                            "{{ n }}{{ range(3) | list }}") == {"people"}


def test_plain_render_encodes_rendered_text():
    r = renderer()
    ids = r.render({"text": "hello world", "extra": 1})
    assert r.tokenizer.decode(ids) == "Summarize: hello world"


def test_a_template_may_test_a_null_column_and_printing_one_is_the_rows_error():
    for template in ("T{% if note is not none %} {{ note }}{% endif %}", "T {{ note | default('', true) }}",
                     "T {{ note or '' }}", "T{% if note %} {{ note }}{% endif %}"):
        for null in (None, float("nan")):
            assert renderer(template).render_text({"note": null}).strip() == "T", template
        assert renderer(template).render_text({"note": "n"}) == "T n", template
    with pytest.raises(RenderError, match="null_value: column 'note' is null"):
        renderer("T {{ note | upper }}").render_text({"note": None})


def test_columns_named_like_jinja_globals_are_columns_where_not_called():
    assert required_columns("{{ range }} {{ dict(a=1) }}") == {"range"}
    assert required_columns("{% for i in range(2) %}{{ dict(a=i) }}{% endfor %}") == set()
    r = renderer("Distance: {{ range }}")
    assert r.render_text({"range": "1-5 km"}) == "Distance: 1-5 km"
    for row, code in (({}, "missing_column"), ({"range": None}, "null_value")):
        with pytest.raises(RenderError, match=code):
            r.render_text(row)


def test_a_runaway_template_stops_rendering_past_the_character_limit(monkeypatch):
    """Nested loops would render 10^10 characters: memory and time stay bounded by max_chars."""
    monkeypatch.setattr(render, "_RENDER_FLOOR", 10_000)  # (a row may hold 64M characters: that takes seconds)
    r = renderer("{% for i in range(100000) %}{% for j in range(100000) %}{{ text }}{% endfor %}{% endfor %}")
    assert r.render_text({"text": "ab"}, 1000, "right") == "ab" * 500
    for mode in ("error", "left"):
        with pytest.raises(RenderError, match="prompt_too_long: prompt has more than .* max 1000 .*rendering stopped"):
            r.render_text({"text": "ab"}, 1000, mode)
    tail = renderer("{% for i in range(3000) %}{{ i }},{% endfor %}").render_text({}, 100, "left")
    assert tail == "".join(f"{i}," for i in range(3000))[-100:]
    with pytest.raises(RenderError, match="prompt has 13890 characters > max 100"):
        renderer("{% for i in range(3000) %}{{ i }},{% endfor %}").render_text({}, 100, "error")


def test_tojson_writes_plain_json():
    """Jinja's own tojson would write HTML escapes and \\uXXXX for every non-ASCII character into the prompt."""
    record = {"name": "Café Müller", "rule": "a < b && c > d", "q": "it's 😀"}
    r = PromptRenderer("{{ record | tojson }}", None, False, WordTokenizer())
    assert r.render_text({"record": record}) == json.dumps(record, ensure_ascii=False)
    indented = PromptRenderer("{{ record | tojson(2) }}", None, False, WordTokenizer())  # Jinja's indent argument
    assert indented.render_text({"record": record}) == json.dumps(record, ensure_ascii=False, indent=2)
    with pytest.raises(RenderError, match="null_value: column 'record' is null"):
        r.render_text({"record": None})


def test_chat_render_with_and_without_system():
    r = renderer(system="Be brief.", chat=True)
    assert r.tokenizer.decode(r.render({"text": "hi"})) == "<1> system Be brief. <2> <1> user Summarize: hi <2> <1> assistant"
    r = renderer(chat=True)
    assert r.tokenizer.decode(r.render({"text": "hi"})) == "<1> user Summarize: hi <2> <1> assistant"


@pytest.mark.parametrize(
    ("template", "row", "code", "needle"),
    [
        ("{{ text }}", {"title": "x"}, "missing_column", "column 'text' is missing"),
        ("{{ a }} {{ b }}", {}, "missing_column", "columns 'a', 'b' are missing"),
        ("{{ text }}", {"text": None}, "null_value", "column 'text' is null"),
        ("{{ text }}", {"text": float("nan")}, "null_value", "column 'text' is null"),
        ("{{ text }}", {"text": "  \n\t "}, "empty_prompt", "empty"),
        ("{{ meta.author }}", {"meta": {}}, "template_error", "author"),
        ("{{ 1 // n }}", {"n": 0}, "template_error", "ZeroDivisionError"),
        ("{{ xs.append(1) }}", {"xs": []}, "template_error", "SecurityError"),
        ("{{ text.__class__.__mro__ }}", {"text": "x"}, "template_error", ""),
    ],
)
def test_row_errors(template, row, code, needle):
    with pytest.raises(RenderError) as info:
        renderer(template).render(row)
    assert info.value.code == code
    assert needle in info.value.message
    assert str(info.value).startswith(f"{code}: ")


def test_optional_columns_via_default_and_defined():
    r = renderer("{% if title is defined %}{{ title }}: {% endif %}{{ text }} {{ lang | default('en') }}")
    assert r.tokenizer.decode(r.render({"text": "body"})) == "body en"
    assert r.tokenizer.decode(r.render({"text": "body", "title": "T", "lang": "fr"})) == "T: body fr"


def test_tokenizer_failure_is_a_row_error():
    class Broken(WordTokenizer):
        def encode(self, text):
            raise UnicodeError("bad char")

    with pytest.raises(RenderError) as info:
        PromptRenderer("{{ text }}", None, False, Broken()).render({"text": "x"})
    assert info.value.code == "tokenizer_error"


def test_syntax_error_is_reported_with_line():
    with pytest.raises(ValueError, match="line 2"):
        check_template("ok\n{{ text }")
    with pytest.raises(ValueError, match="syntax error"):
        renderer("{% for x in y %}")


def test_truncate():
    ids = list(range(10))
    assert truncate(ids, 10, "error") == ids
    assert truncate(ids, 4, "left") == [6, 7, 8, 9]
    assert truncate(ids, 4, "right") == [0, 1, 2, 3]
    with pytest.raises(RenderError) as info:
        truncate(ids, 4, "error")
    assert info.value.code == "prompt_too_long"
    assert "10 tokens > max 4" in info.value.message
