"""Field types the job spec's sections share: numbers that refuse YAML's booleans."""
from __future__ import annotations

import types
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import BeforeValidator


def not_a_bool(value: Any) -> Any:
    """A number field refuses YAML's booleans (pydantic would take true, yes or on as 1)."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number, got {str(value).lower()}")
    return value


NOT_BOOL = BeforeValidator(not_a_bool)
T = TypeVar("T")
Number = Annotated[T, NOT_BOOL]  # Number[int]: an int field that refuses YAML's booleans


def number_type(hint: Any) -> Any:
    """``hint`` refusing booleans where it takes a number (int, float, or either of them or None)."""
    args = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    return Annotated[hint, NOT_BOOL] if {int, float} & set(args) else hint
