"""The base of every manifest model: camelCase keys, unknown fields refused, values frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    """Base of every manifest model: camelCase keys, unknown fields refused, values frozen."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=False,
    )
