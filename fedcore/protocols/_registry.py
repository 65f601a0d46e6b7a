"""Protocols by name: ``register_protocol`` adds one, ``create_protocol`` builds one."""

from __future__ import annotations

from fedcore.protocols._base import Protocol

_PROTOCOLS: dict[str, type[Protocol]] = {}


def register_protocol(name: str, cls: type[Protocol], *, force: bool = False) -> None:
    """Registers ``cls`` under ``name``.

    Raises:
        ValueError: ``name`` is taken and ``force`` is false.
    """
    if name in _PROTOCOLS and not force:
        raise ValueError(f"A protocol named {name!r} is already registered.")
    _PROTOCOLS[name] = cls


def create_protocol(name: str) -> Protocol:
    """Returns a new instance of the protocol registered as ``name``.

    Raises:
        ValueError: no protocol has that name.
    """
    try:
        cls = _PROTOCOLS[name]
    except KeyError:
        known = ", ".join(sorted(_PROTOCOLS)) or "none"
        raise ValueError(f"Unknown protocol {name!r}; registered protocols: {known}.") from None
    return cls()


def registered_protocols() -> list[str]:
    """Returns the registered names, sorted."""
    return sorted(_PROTOCOLS)
