"""Prompt rendering: a sandboxed Jinja2 template per row, then token ids via the model's tokenizer."""
from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterator, Literal, Mapping, Protocol, Sequence

from jinja2 import StrictUndefined, TemplateAssertionError, TemplateSyntaxError, UndefinedError, meta, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from batchgen.engine.tokenizer import tojson

TruncateMode = Literal["error", "left", "right"]

_ENV = ImmutableSandboxedEnvironment(undefined=StrictUndefined, autoescape=False)


class PromptTokenizer(Protocol):
    """What rendering a prompt needs from a tokenizer (the engine's ModelTokenizer is one)."""

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class RenderError(Exception):
    """A row that cannot become a prompt; ``code`` is a stable machine-readable reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def check_template(template: str) -> None:
    """Raises ``ValueError`` naming the line of a Jinja2 syntax error, or of a filter or test that does not exist
    (compiling finds those)."""
    try:
        _ENV.from_string(template)
    except TemplateAssertionError as e:  # an unknown filter or test
        raise ValueError(f"template error at line {e.lineno}: {e.message}") from None
    except TemplateSyntaxError as e:
        raise ValueError(f"template syntax error at line {e.lineno}: {e.message}") from None


def required_columns(template: str) -> set[str]:
    """Input columns the template reads (variables it uses but does not define itself); a name of Jinja's globals
    (``range``, ``dict``, ...) is a column where it is not only called."""
    ast = _ENV.parse(template)
    called = {c.node.name for c in ast.find_all(nodes.Call) if isinstance(c.node, nodes.Name)}
    names = list(ast.find_all(nodes.Name))
    stored = {n.name for n in names if n.ctx != "load"}
    plain_globals = {n.name for n in names if n.ctx == "load" and n.name in _ENV.globals} - called - stored
    return meta.find_undeclared_variables(ast) | plain_globals


class _Null(StrictUndefined):
    """A null column's value: false, not defined, and ``none`` to the template's tests (so that it can test for it);
    an error wherever it is printed or used."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return False


_ENV.tests["none"] = lambda value: value is None or isinstance(value, _Null)


def _tojson(value: Any, indent: int | None = None) -> str:
    """Jinja's ``tojson(indent)`` writing plain JSON (Jinja's own escapes HTML characters and all non-ASCII ones);
    a null column is this row's null_value, as wherever it is used."""
    if isinstance(value, _Null):
        value._fail_with_undefined_error()
    return tojson(value, indent=indent)


_ENV.filters["tojson"] = _tojson


def _is_null(value: Any) -> bool:
    # Parquet written from pandas stores missing floats as NaN rather than null.
    return value is None or (isinstance(value, float) and math.isnan(value))


class PromptRenderer:
    """Turns input rows into prompt token ids; any per-row failure raises :class:`RenderError`."""

    def __init__(self, template: str, system: str | None, chat: bool, tokenizer: PromptTokenizer) -> None:
        check_template(template)
        self.template = _ENV.from_string(template)
        self.columns = required_columns(template)
        self.system = system
        self.chat = chat
        self.tokenizer = tokenizer

    def render_text(self, row: Mapping[str, Any], max_chars: int | None = None, mode: TruncateMode = "error") -> str:
        """The rendered user prompt, before any chat template, fit to ``max_chars`` as :func:`fit_chars` says while
        it is rendered (a template's output past it is never held whole). A null (or NaN) column the template
        prints or uses is a ``null_value`` error; one it only tests (``is none``, ``default(..., true)``, ``or``)
        is not."""
        shadowed = sorted(c for c in self.columns if c in _ENV.globals and c not in row)  # else Jinja's own
        if shadowed:
            raise RenderError("missing_column", f"column '{shadowed[0]}' is missing")
        values = dict(row)
        nulls = {f"column '{c}' is null" for c in self.columns if c in row and _is_null(row[c])}
        for hint in nulls:
            name = hint.split("'")[1]
            values[name] = _Null(hint=hint, name=name)
        try:
            text = _bounded(self.template.generate(values), max_chars, mode)
        except RenderError:
            raise
        except UndefinedError as e:
            if e.message in nulls:
                raise RenderError("null_value", e.message) from None
            # Absent columns are left to Jinja so that `is defined` and `| default(...)` keep working.
            missing = sorted(c for c in self.columns if c not in row)
            if missing:
                names = ", ".join(f"'{c}'" for c in missing)
                what = f"column {names} is" if len(missing) == 1 else f"columns {names} are"
                raise RenderError("missing_column", f"{what} missing") from None
            raise RenderError("template_error", f"UndefinedError: {e}") from None
        except Exception as e:  # noqa: BLE001 - any template failure is this row's error
            raise RenderError("template_error", f"{type(e).__name__}: {e}") from None
        if not text.strip():
            raise RenderError("empty_prompt", "rendered prompt is empty")
        return text

    def messages(self, text: str) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        return msgs + [{"role": "user", "content": text}]

    def render(self, row: Mapping[str, Any]) -> list[int]:
        """Token ids of the row's prompt, chat-wrapped when ``chat`` is set."""
        return self.encode(self.render_text(row))

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendered prompt, chat-wrapped when ``chat`` is set."""
        try:
            if self.chat:
                ids = self.tokenizer.apply_chat_template(self.messages(text), add_generation_prompt=True)
            else:
                ids = self.tokenizer.encode(text)
        except Exception as e:  # noqa: BLE001 - e.g. a character the tokenizer cannot handle
            raise RenderError("tokenizer_error", f"{type(e).__name__}: {e}") from None
        return list(ids)


# Rendering stops past this many times max_chars, and past _RENDER_FLOOR characters (more than a row may hold):
# a runaway loop, whose row is prompt_too_long.
_RENDER_STOP, _RENDER_FLOOR = 256, 1 << 26


def _bounded(chunks: Iterator[str], max_chars: int | None, mode: TruncateMode) -> str:
    """A template's output chunks joined and fit to ``max_chars`` (see fit_chars), holding about that many
    characters at most: "right" stops rendering once it has them, "left" keeps the last ones, "error" counts; a
    runaway template (see _RENDER_STOP) stops with prompt_too_long."""
    if max_chars is None:
        return "".join(chunks)
    parts: deque[str] = deque()
    held = total = 0
    stop = max(_RENDER_STOP * max_chars, _RENDER_FLOOR)
    for chunk in chunks:
        total += len(chunk)
        if total > stop:
            raise RenderError("prompt_too_long", f"prompt has more than {total} characters > max {max_chars} "
                                                 f"(batching.max_prompt_chars); rendering stopped")
        if mode == "right" and held >= max_chars:
            break
        if mode != "error" or held <= max_chars:
            parts.append(chunk)
            held += len(chunk)
        while mode == "left" and held - len(parts[0]) >= max_chars:
            held -= len(parts.popleft())
    text = "".join(parts)
    if mode == "error" and total > max_chars:
        raise RenderError("prompt_too_long", f"prompt has {total} characters > max {max_chars} "
                                             f"(batching.max_prompt_chars)")
    return fit_chars(text, max_chars, mode)


def fit_chars(text: str, max_chars: int, mode: TruncateMode) -> str:
    """Bounds a rendered prompt before it is tokenized (tokenizing costs ~150 MB per million characters).

    "error" raises ``prompt_too_long``; "left" keeps the last ``max_chars`` characters, "right" the first,
    so that the token-level truncation after it keeps the same end of the prompt.
    """
    if len(text) <= max_chars:
        return text
    if mode == "error":
        raise RenderError("prompt_too_long", f"prompt has {len(text)} characters > max {max_chars} "
                                             f"(batching.max_prompt_chars)")
    return text[len(text) - max_chars:] if mode == "left" else text[:max_chars]


def truncate(ids: Sequence[int], max_prompt_tokens: int, mode: TruncateMode) -> list[int]:
    """Fits a prompt into ``max_prompt_tokens``.

    "left" keeps the last tokens (the end of a chat prompt, where the generation prompt sits); "right"
    keeps the first ones, which for a chat prompt also cuts the assistant header.
    """
    n = len(ids)
    if n <= max_prompt_tokens:
        return list(ids)
    if mode == "error":
        raise RenderError("prompt_too_long", f"prompt has {n} tokens > max {max_prompt_tokens}")
    if mode == "left":
        return list(ids[n - max_prompt_tokens:])
    if mode == "right":
        return list(ids[:max_prompt_tokens])
    raise ValueError(f"unknown truncate mode {mode!r}")
