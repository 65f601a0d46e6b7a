"""The base of every manifest model: camelCase keys, unknown fields refused, values frozen, and
values taken as the types they are written in (no coercion)."""

from __future__ import annotations

import functools
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

EXACT_FLOAT_INTEGERS = 2**53
"""The largest whole float taken as an integer: up to it, a float holds every integer exactly."""


class SpecModel(BaseModel):
    """Base of every manifest model: camelCase keys, unknown fields refused, values frozen.

    Validation is strict: no value changes type on the way in. A boolean or a string is never
    a number (``rounds: true``, ``rounds: "20"`` and ``learningRate: "0.1"`` are refused), a
    number or a string is never a boolean, and no float field takes an infinity or NaN. Two
    widenings remain, both exact and both what JSON (and so the API server) does: an integer
    is a valid number (``learningRate: 1``), and in a field that takes integers, a whole
    float is the integer it equals (``count: 1.0``; kubectl sends it as ``1``). A field set
    to null is unset, as kubectl drops a null before the API server sees it: its default
    applies, and a required field is missing.
    """

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=False,
        strict=True,
        allow_inf_nan=False,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """Leaves out the fields given as null (``backoffLimit: null`` is the default)."""
        if isinstance(data, dict) and any(value is None for value in data.values()):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("*", mode="before")
    @classmethod
    def _whole_floats_as_integers(cls, value: Any, info: ValidationInfo) -> Any:
        """In a field whose type involves ``int`` (also in lists), ``1.0`` becomes ``1``."""
        if info.field_name is not None and _takes_integers(cls, info.field_name):
            return _whole_as_int(value, levels=3)
        return value


@functools.cache
def _takes_integers(model: type[BaseModel], field_name: str) -> bool:
    """Whether the field's type mentions ``int`` (``int``, ``int | None``, ``list[int]``, an
    int-or-percent); ``bool`` and ``float`` do not count."""
    field = model.model_fields.get(field_name)
    return field is not None and _mentions_int(field.annotation)


def _mentions_int(annotation: Any) -> bool:
    if annotation is int:
        return True
    return any(_mentions_int(argument) for argument in get_args(annotation))


def _whole_as_int(value: Any, *, levels: int) -> Any:
    """``value`` with each whole float (up to :data:`EXACT_FLOAT_INTEGERS`) made an int, also
    inside lists ``levels`` deep; anything else is returned as it is, for strict validation."""
    if type(value) is float and value.is_integer() and abs(value) <= EXACT_FLOAT_INTEGERS:
        return int(value)
    if type(value) is list and levels > 0:
        return [_whole_as_int(item, levels=levels - 1) for item in value]
    return value
