"""Reading a manifest's YAML safely: bounded size, depth and alias expansion, one plain document.

``load_document`` turns bytes or text into the plain data (dicts, lists, strings, numbers,
booleans, null) that validation takes, and refuses, each with one issue naming the problem and
its line and column where known:

- input larger than :data:`MAX_MANIFEST_BYTES`, input that is not UTF-8 (a UTF-8 byte-order mark
  is accepted), binary input;
- no document (nothing, only comments, or null), more than one document, a top level that is
  not a mapping;
- a key given twice in one mapping (both lines named), a key that is not a string (``on:``,
  ``1:``, ``null:`` or a list), tags other than YAML's plain types (``!!binary``, ``!!set``,
  ``!!python/...``, local tags);
- nesting deeper than :data:`MAX_DEPTH`, aliases that would stand for more than
  :data:`MAX_ALIAS_NODES` nodes, recursive aliases, documents of more than :data:`MAX_NODES`
  nodes.

The checks run while the document is composed, before any value is built, so an alias bomb
("billion laughs") is refused after reading a few dozen nodes: each alias is counted as the
nodes it stands for without expanding it. Aliases are allowed within the budget (kubectl
accepts them, and a shared ``resources`` block is a fair use); merge keys (``<<: *base``) too.

Scalars resolve as YAML 1.1 does (as kubectl's YAML reader does), with two changes that match
what reaches the API server: timestamps stay strings, and exponent floats without a dot or a
sign (``1e-3``, ``1e3``) are numbers, not strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.events import AliasEvent, MappingEndEvent, SequenceEndEvent, StreamEndEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.resolver import Resolver

from fedcore.errors import SpecError, SpecIssue

if TYPE_CHECKING:
    _EventSource = yaml.SafeLoader
else:
    try:  # libyaml's event parser: some 4 times as fast, and kin to kubectl's (go-yaml)
        from yaml._yaml import CParser

        class _EventSource(Composer, CParser, SafeConstructor, Resolver):
            """libyaml's events, composed and built in Python (so the checks below apply)."""

            def __init__(self, text: str) -> None:
                CParser.__init__(self, text)
                Composer.__init__(self)
                SafeConstructor.__init__(self)
                Resolver.__init__(self)

    except ImportError:  # PyYAML built without libyaml: the same, all in Python
        _EventSource = yaml.SafeLoader

_POSITIONS_IN_BYTES = _EventSource is not yaml.SafeLoader
"""libyaml reports a bad character's position in UTF-8 bytes, PyYAML's reader in characters."""

MAX_MANIFEST_BYTES = 1024 * 1024
"""Manifests larger than this (1 MiB, counted in UTF-8 bytes) are refused before parsing.

An object the API server stores must fit etcd's 1.5 MiB request limit anyway, and a large
real manifest (an lppa edge list of 20,000 links for 10,000 clients) is about 0.25 MiB."""

MAX_DEPTH = 64
"""The deepest nesting of mappings and lists allowed; the top-level mapping is depth 1.

The models nest at most about 10 levels, and a pod template rarely passes 20; deeper input
is refused before it could exhaust the recursion of later stages (a RecursionError)."""

MAX_ALIAS_NODES = 10_000
"""The most nodes the aliases of one manifest may stand for, all aliases together, each one
counted as the size of what it names (a 3-node list aliased 5 times counts 15).

Ten thousand nodes is some hundred times the size of a pod template or a resources block, the
things worth sharing; the aliases of the billion-laughs document (nine levels of nine) stand
for 490 million nodes, and it is refused at its fifth level."""

MAX_NODES = 1_000_000
"""The most nodes one manifest may hold, every alias counted as the nodes it stands for.

This bounds the work of every later stage (building values, validation, error messages)
whatever the input. A manifest within :data:`MAX_MANIFEST_BYTES` holds at most about half a
million nodes written out, plus :data:`MAX_ALIAS_NODES` through aliases."""

_STR = "tag:yaml.org,2002:str"
_MERGE = "tag:yaml.org,2002:merge"
_PLAIN_TAGS = frozenset(
    {
        "tag:yaml.org,2002:null",
        "tag:yaml.org,2002:bool",
        "tag:yaml.org,2002:int",
        "tag:yaml.org,2002:float",
        _STR,
        "tag:yaml.org,2002:seq",
        "tag:yaml.org,2002:map",
    }
)
"""The tags a manifest may use: JSON's types, which is all the API server stores."""

_TAG_WORDS = {
    "tag:yaml.org,2002:null": "null",
    "tag:yaml.org,2002:bool": "a boolean",
    "tag:yaml.org,2002:int": "an integer",
    "tag:yaml.org,2002:float": "a number",
    "tag:yaml.org,2002:seq": "a list",
    "tag:yaml.org,2002:map": "a mapping",
}

_BOMS = (
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\xfe\xff", "UTF-16"),
    (b"\xff\xfe", "UTF-16"),
)
"""Byte-order marks of the encodings a manifest is sometimes saved in by mistake."""


@dataclass
class LoadStats:
    """What one load read; pass one to ``load_document`` to see it (tests bound the work by it).

    Attributes:
        nodes: nodes composed, each alias counted as the nodes it stands for; this is the
            number of values every later stage would visit. Never above :data:`MAX_NODES`
            (the load is refused first).
        alias_nodes: the part of ``nodes`` that aliases stand for; never above
            :data:`MAX_ALIAS_NODES`.
        depth: the deepest nesting reached; never above :data:`MAX_DEPTH`.
    """

    nodes: int = 0
    alias_nodes: int = 0
    depth: int = 0


class _Refused(Exception):
    """A problem the loader names itself (raised inside the parser, turned into a SpecIssue)."""

    def __init__(self, message: str, *, path: str = "<file>") -> None:
        self.path = path
        super().__init__(message)


def read_manifest_bytes(path: Path) -> bytes:
    """Reads at most :data:`MAX_MANIFEST_BYTES` (plus one, to tell) of a file.

    Raises:
        SpecError: the file cannot be read or is too large.
    """
    label = str(path)
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise _too_large(label)
        with path.open("rb") as stream:
            data = stream.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise SpecError([SpecIssue("<file>", f"cannot be read: {reason}.")], source=label) from exc
    if len(data) > MAX_MANIFEST_BYTES:
        raise _too_large(label)
    return data


def load_document(data: bytes | str, *, source: str, stats: LoadStats | None = None) -> Any:
    """Parses one manifest document into plain data, refusing anything unsafe or ambiguous.

    Args:
        data: the manifest as bytes (must be UTF-8) or text.
        source: the file name (or a label) for error messages.
        stats: filled in with what the load read, when given.

    Returns:
        The top-level mapping as a dict of plain values.

    Raises:
        SpecError: one issue naming the problem and where; no other exception escapes.
    """
    stats = stats if stats is not None else LoadStats()
    text = ""
    try:
        text = _decode(data)
        loader = _ManifestLoader(text, stats)
        try:
            return loader.load()
        finally:
            loader.dispose()
    except _Refused as exc:
        issue = SpecIssue(exc.path, str(exc))
    except yaml.MarkedYAMLError as exc:
        if "nesting depth" in (exc.problem or "") and exc.problem_mark is not None:
            # libyaml's own limit (1000 levels), met while it reads ahead of our check
            message = (
                f"nests deeper than {MAX_DEPTH} levels (by {_at(exc.problem_mark)}); the most "
                f"allowed is {MAX_DEPTH}."
            )
        else:
            message = f"is not valid YAML: {_yaml_problem(exc)}."
        issue = SpecIssue("<file>", message)
    except yaml.reader.ReaderError as exc:
        issue = SpecIssue("<file>", _reader_problem(exc, text))
    except yaml.YAMLError as exc:
        issue = SpecIssue("<file>", f"is not valid YAML: {_one_line(str(exc))}.")
    except (RecursionError, MemoryError) as exc:
        issue = SpecIssue("<file>", f"cannot be read: {type(exc).__name__} while parsing.")
    except Exception as exc:  # a last resort: no traceback for any input
        issue = SpecIssue("<file>", f"cannot be read: {type(exc).__name__}: {_one_line(str(exc))}.")
    raise SpecError([issue], source=source)


def _too_large(label: str) -> SpecError:
    return SpecError(
        [
            SpecIssue(
                "<file>",
                f"is larger than {MAX_MANIFEST_BYTES} bytes (1 MiB), the most a manifest may be.",
            )
        ],
        source=label,
    )


def _decode(data: bytes | str) -> str:
    """Checks size and encoding; returns the text without a UTF-8 byte-order mark."""
    if isinstance(data, str):
        try:
            data = data.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise _Refused(
                f"is not valid Unicode text: character {exc.object[exc.start]!r} at offset "
                f"{exc.start} cannot be written as UTF-8."
            ) from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise _Refused(
            f"is larger than {MAX_MANIFEST_BYTES} bytes (1 MiB), the most a manifest may be."
        )
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise _Refused(
                f"is {name} text (it starts with a {name} byte-order mark); a manifest must be "
                f"UTF-8."
            )
    nul = data.find(b"\x00")
    if nul >= 0:
        raise _Refused(
            f"holds a NUL byte at {_where_byte(data, nul)}: it is binary or UTF-16/UTF-32 "
            f"data, and a manifest must be UTF-8 text."
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        where = _where_byte(data, exc.start)
        raise _Refused(
            f"is not UTF-8 text: the byte 0x{data[exc.start]:02x} at {where} cannot be decoded "
            f"({exc.reason}); save the manifest as UTF-8."
        ) from None


def _where_byte(data: bytes, offset: int) -> str:
    line = data.count(b"\n", 0, offset) + 1
    column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
    return f"line {line}, column {column} (byte offset {offset})"


def _at(mark: Any) -> str:
    """``line L, column C`` of a PyYAML mark (which counts from 0)."""
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line, without its final full stop, cut to ``limit`` characters."""
    line = " ".join(text.split()).rstrip(".")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    """PyYAML's several-line message as one line: the problem, where, and its context."""
    parts = []
    if exc.problem:
        problem = _one_line(exc.problem)
        parts.append(f"{problem} at {_at(exc.problem_mark)}" if exc.problem_mark else problem)
    if exc.context:
        context = _one_line(exc.context)
        if exc.context_mark is not None and (
            exc.problem_mark is None or exc.context_mark.line != exc.problem_mark.line
        ):
            context += f" started at {_at(exc.context_mark)}"
        parts.append(f"({context})" if parts else context)
    return " ".join(parts) or "unknown error"


def _reader_problem(exc: yaml.reader.ReaderError, text: str) -> str:
    """A character YAML forbids (a control character): where it is."""
    position = exc.position
    if _POSITIONS_IN_BYTES:
        position = len(text.encode("utf-8")[:position].decode("utf-8", "ignore"))
    line = text.count("\n", 0, position) + 1
    column = position - (text.rfind("\n", 0, position) + 1) + 1
    character = exc.character if isinstance(exc.character, str) else chr(exc.character)
    return (
        f"holds the control character {character!r} at line {line}, column {column}; a "
        f"manifest is text (binary data is not allowed)."
    )


def _describe_key(node: Node) -> str:
    if isinstance(node, ScalarNode):
        kind = _TAG_WORDS.get(node.tag, "a value")
        return f"{node.value!r}, read as {kind}" if node.value else f"an empty key, read as {kind}"
    return _TAG_WORDS.get(node.tag, "a collection")


class _ManifestLoader(_EventSource):
    """A safe loader (plain tags only) with the manifest's checks made while composing; see the
    module docstring. Events come from libyaml when PyYAML has it, else from PyYAML's parser."""

    def __init__(self, text: str, stats: LoadStats) -> None:
        super().__init__(text)
        self.stats = stats
        self.path: list[str] = []
        self.sizes: dict[int, int] = {}

    # ------------------------------------------------------------------------ the document

    def load(self) -> Any:
        """Composes and builds the one document; see ``load_document``."""
        self.get_event()  # StreamStartEvent
        if self.check_event(StreamEndEvent):
            raise _Refused("is empty: it holds no YAML document (only blank lines or comments).")
        root = self.compose_document()
        if not self.check_event(StreamEndEvent):
            second = self.peek_event()
            raise _Refused(
                f"holds more than one YAML document (another starts at {_at(second.start_mark)}); "
                f"a manifest is one document, without '---' separators between runs."
            )
        if root is None or (isinstance(root, ScalarNode) and root.tag == "tag:yaml.org,2002:null"):
            raise _Refused("is empty: its only document is null.")
        if not isinstance(root, MappingNode):
            kind = "a string" if root.tag == _STR else _TAG_WORDS.get(root.tag, "a scalar")
            raise _Refused(
                f"must be a mapping with apiVersion, kind, metadata and spec, got {kind} at "
                f"{_at(root.start_mark)}.",
                path="<root>",
            )
        return self.construct_document(root)

    # ------------------------------------------------------------------------- composition

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        """Composes one node, checking its depth, tag and the count; records its size."""
        if self.check_event(AliasEvent):
            return self._alias()
        event = self.peek_event()
        depth = len(self.path) + 1
        if depth > MAX_DEPTH:
            raise _Refused(
                f"nests deeper than {MAX_DEPTH} levels at {_at(event.start_mark)} (under "
                f"{self._path_text()}); the most allowed is {MAX_DEPTH}."
            )
        self.stats.depth = max(self.stats.depth, depth)
        self._count(1, event.start_mark)
        node = super().compose_node(parent, index)
        if node is None:  # cannot happen: an event was there
            raise _Refused(f"ends unexpectedly at {_at(event.start_mark)}.")
        merge_key = node.tag == _MERGE and self.path[-1:] == [".?"]
        if node.tag not in _PLAIN_TAGS and not merge_key:
            raise _Refused(
                f"uses the tag {node.tag!r} at {_at(node.start_mark)}; a manifest holds only "
                f"mappings, lists, strings, numbers, booleans and null.",
                path=self._path_text(),
            )
        size = 1
        if isinstance(node, SequenceNode):
            size += sum(self.sizes[id(child)] for child in node.value)
        elif isinstance(node, MappingNode):
            size += sum(self.sizes[id(k)] + self.sizes[id(v)] for k, v in node.value)
        self.sizes[id(node)] = size
        return node

    def _alias(self) -> Node:
        """The node an alias names, counted as its size against the alias budget."""
        event = self.get_event()
        node = self.anchors.get(event.anchor)
        if node is None:
            raise _Refused(
                f"uses the alias *{event.anchor} at {_at(event.start_mark)}, but no anchor "
                f"&{event.anchor} comes before it."
            )
        size = self.sizes.get(id(node))
        if size is None:
            raise _Refused(
                f"uses the alias *{event.anchor} at {_at(event.start_mark)} inside the value "
                f"it names (a recursive structure), which a manifest cannot hold."
            )
        aliased = self.stats.alias_nodes + size
        if aliased > MAX_ALIAS_NODES:
            raise _Refused(
                f"uses the alias *{event.anchor} at {_at(event.start_mark)}, which would make "
                f"its aliases stand for {aliased} nodes; at most {MAX_ALIAS_NODES} are allowed "
                f"(an alias bomb?)."
            )
        self._count(size, event.start_mark)
        self.stats.alias_nodes = aliased
        return node

    def _count(self, nodes: int, mark: Any) -> None:
        """Counts ``nodes`` more, refusing the document first if that passes MAX_NODES."""
        if self.stats.nodes + nodes > MAX_NODES:
            raise _Refused(
                f"holds more than {MAX_NODES} nodes (aliases counted as what they stand for) "
                f"by {_at(mark)}."
            )
        self.stats.nodes += nodes

    def compose_sequence_node(self, anchor: Any) -> SequenceNode:
        """PyYAML's, keeping the path of each item for messages."""
        start = self.get_event()
        tag = start.tag
        if tag is None or tag == "!":
            tag = self.resolve(SequenceNode, None, start.implicit)
        node = SequenceNode(tag, [], start.start_mark, None, flow_style=start.flow_style)
        if anchor is not None:
            self.anchors[anchor] = node
        index = 0
        while not self.check_event(SequenceEndEvent):
            self.path.append(f"[{index}]")
            node.value.append(self.compose_node(node, index))
            self.path.pop()
            index += 1
        node.end_mark = self.get_event().end_mark
        return node

    def compose_mapping_node(self, anchor: Any) -> MappingNode:
        """PyYAML's, refusing a key given twice and keys that are not strings."""
        start = self.get_event()
        tag = start.tag
        if tag is None or tag == "!":
            tag = self.resolve(MappingNode, None, start.implicit)
        node = MappingNode(tag, [], start.start_mark, None, flow_style=start.flow_style)
        if anchor is not None:
            self.anchors[anchor] = node
        seen: dict[str, Any] = {}
        while not self.check_event(MappingEndEvent):
            self.path.append(".?")
            key = self._compose_key(node)
            self.path.pop()
            name = "<<" if key.tag == _MERGE else str(key.value)
            if name in seen:
                where = self._path_text(name)
                first, second = seen[name], key.start_mark
                lines = (
                    f"line {first.line + 1} and line {second.line + 1}"
                    if first.line != second.line
                    else f"{_at(first)} and column {second.column + 1}"
                )
                raise _Refused(
                    f"is given twice in one mapping, at {lines}; a key may appear once (YAML "
                    f"would silently keep the last).",
                    path=where,
                )
            seen[name] = key.start_mark
            self.path.append(f".{name}")
            value = self.compose_node(node, key)
            self.path.pop()
            node.value.append((key, value))
        node.end_mark = self.get_event().end_mark
        return node

    def _compose_key(self, parent: Node) -> Node:
        """A mapping's next key, which must be a string (or a merge key)."""
        key = self.compose_node(parent, None)
        if isinstance(key, ScalarNode) and key.tag in (_STR, _MERGE):
            return key  # a string, or a merge key ('<<: *base') that the resolver tagged
        raise _Refused(
            f"has a key that is not a string at {_at(key.start_mark)} ({_describe_key(key)}); "
            f"every key of a manifest is a string: quote it (e.g. 'on' or '1').",
            path=self._path_text(),
        )

    def _path_text(self, last: str | None = None) -> str:
        parts = [part for part in self.path if part != ".?"]
        if last is not None:
            parts.append(f".{last}")
        text = "".join(parts).lstrip(".") or "<root>"
        return text if len(text) <= 80 else f"{text[:40]}...{text[-36:]}"

    # ------------------------------------------------------------------------ construction

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        """SafeConstructor's, naming where a value cannot be built (an integer too long)."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:
            if node.tag == "tag:yaml.org,2002:int":
                digits = sum(character.isdigit() for character in str(node.value))
                raise _Refused(
                    f"has an integer of {digits} digits at {_at(node.start_mark)}, too long to "
                    f"read; no field takes one of more than 16 digits."
                ) from None
            raise _Refused(
                f"has a value at {_at(node.start_mark)} that cannot be read: {_one_line(str(exc))}."
            ) from None


def _plain_resolvers() -> dict[Any, list[tuple[str, re.Pattern[str]]]]:
    """SafeLoader's implicit resolvers without timestamps (they stay strings)."""
    resolvers: dict[Any, list[tuple[str, re.Pattern[str]]]] = {}
    for first, entries in yaml.SafeLoader.yaml_implicit_resolvers.items():
        kept = [(tag, regexp) for tag, regexp in entries if tag != "tag:yaml.org,2002:timestamp"]
        if kept:
            resolvers[first] = kept
    return resolvers


_ManifestLoader.yaml_implicit_resolvers = _plain_resolvers()
_ManifestLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)
