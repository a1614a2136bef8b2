"""Reading GGUF metadata fields as plain Python values (shared by the GGUF loader and tokenizer)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping


def gguf_fields(source: Any) -> Mapping[str, Any]:
    """The metadata fields of a GGUF path, ``GGUFReader`` or an already extracted mapping."""
    if isinstance(source, (str, Path)):
        import gguf

        source = gguf.GGUFReader(str(source))
    return getattr(source, "fields", source)


def field_value(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as plain Python (str, number, bool or list); ``default`` when absent."""
    field = fields.get(key)
    if field is None:
        return default
    return field.contents() if hasattr(field, "contents") else field


def as_int(value: Any, key: str) -> int | None:
    """An integer field; a per-layer list only when all its values agree (an HF config has one)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"GGUF metadata {key} varies per layer ({value}); not supported")
        value = value[0]
    return None if value is None else int(value)
