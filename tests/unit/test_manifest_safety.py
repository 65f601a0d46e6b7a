"""Hostile manifests through the loader: each gets one SpecError naming the problem and the field.

A table of hand-written cases (the ones of issue 24 and more), the facts validation relies on
(the built-in data sets' sizes, the operator's longest object name), the run-time refusal of data
that validation cannot see, and hypothesis properties: generated documents never raise anything
but SpecError and never make the loader visit more than a bounded number of nodes (counted by the
loader's ``LoadStats``, not timed).
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedcore.cli import main
from fedcore.errors import DataError, FedcoreError, SpecError, SpecIssue
from fedcore.spec import load_manifest, parse_manifest
from fedcore.spec._datasets import BUILTIN_DATASETS, split_sizes
from fedcore.spec._loading import (
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    MAX_MANIFEST_BYTES,
    MAX_NODES,
    LoadStats,
    load_document,
)
from fedcore.spec._run import longest_object_name

VALID = """\
apiVersion: fedcore.dev/v1alpha1
kind: FederatedRun
metadata:
  name: safety-test
spec:
  protocol:
    name: fedavg
  model:
    kind: MLP
    hidden: [32]
  data:
    source:
      kind: Digits
    partition:
      kind: IID
  clients:
    count: 10
  rounds: 3
  training:
    batchSize: 16
    optimizer:
      kind: SGD
      learningRate: 0.1
"""
"""A small valid manifest; most cases below change one line of it."""


def _with(old: str, new: str) -> str:
    """VALID with one exact piece of text replaced (the piece must be there)."""
    assert old in VALID, old
    return VALID.replace(old, new, 1)


def _billion_laughs() -> str:
    """The 482-byte alias bomb of issue 24: lol1 to lol9, each a list of 9 aliases of the last."""
    lines = ['lol1: &lol1 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for level in range(2, 10):
        aliases = ",".join([f"*lol{level - 1}"] * 9)
        lines.append(f"lol{level}: &lol{level} [{aliases}]")
    return "\n".join(lines) + "\n"


def _nested_mapping(depth: int) -> str:
    """A mapping ``depth`` levels deep in block style, under metadata.labels's sibling."""
    lines = ["deep:"] + [f"{'  ' * level}k{level}:" for level in range(1, depth)]
    return "\n".join(lines) + " 1\n"


def _case(case_id: str, data: str | bytes, path: str, *fragments: str) -> Any:
    return pytest.param(data, path, fragments, id=case_id)


HOSTILE = [
    # ------------------------------------------------------------- the cases of issue 24
    _case(
        "alias-bomb",
        _billion_laughs(),
        "<file>",
        "uses the alias *lol",
        f"at most {MAX_ALIAS_NODES} are allowed",
    ),
    _case("binary-file", bytes(range(256)) * 8, "<file>", "holds a NUL byte at line 1, column 1"),
    _case(
        "nested-lists-400kb",
        "[" * 200_000 + "]" * 200_000,
        "<file>",
        f"nests deeper than {MAX_DEPTH} levels",
    ),
    _case("empty-file", "", "<file>", "is empty: it holds no YAML document"),
    _case(
        "rounds-true",
        _with("rounds: 3", "rounds: true"),
        "spec.rounds",
        "True is a boolean; expected an integer; allowed: 1 to 1000000.",
    ),
    _case(
        "rounds-quoted",
        _with("rounds: 3", 'rounds: "20"'),
        "spec.rounds",
        "'20' is a string; expected an integer",
    ),
    _case(
        "targetEpsilon-inf",
        _with("name: fedavg", "name: dp-fedavg").replace(
            "  rounds: 3", "  rounds: 3\n  privacy:\n    targetEpsilon: .inf"
        ),
        "spec.privacy.targetEpsilon",
        "inf is an infinity; expected a finite number",
    ),
    _case(
        "duplicate-key",
        _with("  rounds: 3\n", "  rounds: 3\n  rounds: 30\n"),
        "spec.rounds",
        "is given twice in one mapping, at line 18 and line 19",
    ),
    _case(
        "5000-clients-on-digits",
        _with("count: 10", "count: 5000"),
        "spec.clients.count",
        "5000 clients cannot each hold 1 training example",
        "Digits has 1,797 examples",
        "leaving 1,437 for training; allowed: 1 to 1437.",
    ),
    _case(
        "name-starts-with-digit",
        _with("name: safety-test", "name: 9lives"),
        "metadata.name",
        "'9lives' is not allowed: a run's name must start with a lowercase letter",
        "DNS-1035",
    ),
    # -------------------------------------------------------------------- sizes
    _case(
        "over-1-MiB",
        VALID + "#" * MAX_MANIFEST_BYTES + "\n",
        "<file>",
        f"is larger than {MAX_MANIFEST_BYTES} bytes",
    ),
    _case(
        "deep-mapping",
        VALID + _nested_mapping(MAX_DEPTH + 1),
        "<file>",
        f"nests deeper than {MAX_DEPTH} levels",
        "under deep.k1.k2",
    ),
    _case(
        "alias-over-budget",
        f"shared: &big [{','.join(['1'] * 2500)}]\nuses: [*big, *big, *big, *big]\n",
        "<file>",
        "uses the alias *big at line 2, column 26",
        f"stand for 10004 nodes; at most {MAX_ALIAS_NODES}",
    ),
    _case(
        "integer-of-5000-digits",
        _with("rounds: 3", "rounds: " + "7" * 5000),
        "<file>",
        "has an integer of 5000 digits at line 18, column 11",
    ),
    # ---------------------------------------------------------------- encodings
    _case(
        "utf-16-with-bom",
        VALID.encode("utf-16"),
        "<file>",
        "is UTF-16 text (it starts with a UTF-16 byte-order mark)",
    ),
    _case(
        "utf-16-le-without-bom", VALID.encode("utf-16-le"), "<file>", "holds a NUL byte at line 1"
    ),
    _case(
        "latin-1-label",
        _with("name: safety-test", "name: safety-test\n  labels:\n    team: caf\xe9").encode(
            "latin-1"
        ),
        "<file>",
        "is not UTF-8 text: the byte 0xe9 at line 6, column 14",
    ),
    _case(
        "control-character",
        _with("name: fedavg", "name: fed\x07avg"),
        "<file>",
        "holds the control character '\\x07' at line 7, column 14",
    ),
    _case(
        "surrogate-bytes",
        _with("kind: MLP", "kind: \ud800"),
        "<file>",
        "is not UTF-8 text: the byte 0xed at line 9, column 11",
    ),
    # -------------------------------------------------------------- documents and keys
    _case("only-comments", "# a manifest\n\n# to come\n", "<file>", "is empty"),
    _case("null-document", "null\n", "<file>", "is empty: its only document is null"),
    _case(
        "two-documents",
        VALID + "---\n" + VALID,
        "<file>",
        "holds more than one YAML document (another starts at line 24, column 1)",
    ),
    _case(
        "top-level-list",
        "- " + VALID.replace("\n", "\n  "),
        "<root>",
        "must be a mapping with apiVersion, kind, metadata and spec, got a list",
    ),
    _case(
        "key-on-read-as-boolean",
        _with("name: safety-test", "name: safety-test\n  labels:\n    on: yes"),
        "metadata.labels",
        "has a key that is not a string at line 6, column 5 ('on', read as a boolean)",
    ),
    _case(
        "duplicate-key-quoted",
        _with("  name: safety-test\n", '  name: safety-test\n  "name": other\n'),
        "metadata.name",
        "is given twice in one mapping, at line 4 and line 5",
    ),
    _case(
        "binary-tag",
        _with("kind: MLP", "kind: !!binary TUxQ"),
        "spec.model.kind",
        "uses the tag 'tag:yaml.org,2002:binary'",
    ),
    _case(
        "python-tag",
        _with("name: fedavg", "name: !!python/object/apply:os.system [echo]"),
        "spec.protocol.name",
        "uses the tag 'tag:yaml.org,2002:python/object/apply:os.system'",
    ),
    _case(
        "recursive-alias",
        VALID + "loop: &loop [1, *loop]\n",
        "<file>",
        "uses the alias *loop at line 24, column 17 inside the value it names",
    ),
    _case(
        "undefined-alias",
        _with("count: 10", "count: *ten"),
        "<file>",
        "uses the alias *ten at line 17, column 12, but no anchor &ten comes before it",
    ),
    # ---------------------------------------------------------------------- types
    _case(
        "learningRate-quoted",
        _with("learningRate: 0.1", 'learningRate: "0.1"'),
        "spec.training.optimizer.learningRate",
        "'0.1' is a string; expected a number; allowed: more than 0 and at most 100.",
    ),
    _case(
        "learningRate-nan",
        _with("learningRate: 0.1", "learningRate: .nan"),
        "spec.training.optimizer.learningRate",
        "nan is not a number (NaN); expected a finite number",
    ),
    _case(
        "learningRate-boolean",
        _with("learningRate: 0.1", "learningRate: yes"),
        "spec.training.optimizer.learningRate",
        "True is a boolean; expected a number",
    ),
    _case(
        "hidden-fraction",
        _with("hidden: [32]", "hidden: [32.5]"),
        "spec.model.hidden[0]",
        "32.5 is a number with a fractional part; expected an integer",
    ),
    _case(
        "count-quoted",
        _with("count: 10", 'count: "10"'),
        "spec.clients.count",
        "'10' is a string; expected an integer; allowed: 1 to 10000.",
    ),
    _case("rounds-null", _with("rounds: 3", "rounds: null"), "spec.rounds", "is required."),
    _case(
        "bias-integer",
        _with("kind: MLP", "kind: MLP\n    bias: 1"),
        "spec.model.bias",
        "1 is an integer; expected true or false.",
    ),
    _case(
        "bias-quoted-word",
        _with("kind: MLP", 'kind: MLP\n    bias: "yes"'),
        "spec.model.bias",
        "'yes' is a string; expected true or false.",
    ),
    # ----------------------------------------------------------------- cross-field rules
    _case(
        "quorum-over-perRound",
        _with("count: 10", "count: 10\n    perRound: 4\n    quorum: 5"),
        "spec.clients.quorum",
        "5 is more than the 4 clients sampled per round; allowed: 1 to 4 or a percentage.",
    ),
    _case(
        "minExamples-times-count",
        _with("kind: IID", "kind: IID\n      minExamples: 20").replace("count: 10", "count: 100"),
        "spec.clients.count",
        "100 clients cannot each hold 20 training examples",
        "allowed: 1 to 71.",
    ),
    _case(
        "minExamples-over-training-split",
        _with("kind: IID", "kind: Dirichlet\n      minExamples: 2000"),
        "spec.data.partition.minExamples",
        "2000 is more than any client can hold",
        "leaving 1,437 for training; allowed: 1 to 143.",
    ),
    _case(
        "testFraction-leaves-nothing",
        _with("    partition:", "    testFraction: 0.9999\n    partition:"),
        "spec.data.testFraction",
        "0.9999 leaves no training examples",
        "allowed: more than 0 and at most 1796/1797.",
    ),
    _case(
        "mnist-4001-clients",
        _with("kind: Digits", "kind: MNISTSubset").replace("count: 10", "count: 4001"),
        "spec.clients.count",
        "MNISTSubset has 5,000 examples",
        "leaving 4,000 for training; allowed: 1 to 4000.",
    ),
    _case(
        "clusters-over-classes",
        _with("    partition:", "    clusters:\n      count: 11\n    partition:"),
        "spec.data.clusters.count",
        "11 is more than the 10 classes of Digits",
    ),
    _case(
        "name-too-long-for-the-tls-secret",
        _with("name: safety-test", "name: " + "a" * 51),
        "metadata.name",
        "the child name '" + "a" * 51 + "-client-9-tls'",
        "would have 64 characters; at most 63 allowed, so at most 50 characters",
    ),
]


@pytest.mark.parametrize(("data", "path", "fragments"), HOSTILE)
def test_load_manifest_refuses_hostile_manifest(
    data: str | bytes, path: str, fragments: tuple[str, ...], tmp_path: Path
) -> None:
    # Prepare
    manifest = tmp_path / "run.yaml"
    manifest.write_bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)

    # Execute
    with pytest.raises(SpecError) as caught:
        load_manifest(manifest)

    # Assert
    issues = caught.value.issues
    assert [issue.path for issue in issues if issue.path == path] == [path], issues
    message = next(issue.message for issue in issues if issue.path == path)
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message and message.endswith("."), "one full sentence on one line"
    assert str(manifest) in str(caught.value)


@pytest.mark.parametrize(("data", "path", "fragments"), HOSTILE)
def test_fedcore_validate_refuses_hostile_manifest_in_one_line_without_a_traceback(
    data: str | bytes, path: str, fragments: tuple[str, ...], tmp_path: Path
) -> None:
    # Prepare
    manifest = tmp_path / "run.yaml"
    manifest.write_bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)

    # Execute
    done = CliRunner().invoke(main, ["validate", str(manifest)])

    # Assert: exit 1 (a refusal, not 70: an internal error), the field's line, no traceback.
    assert done.exit_code == 1, done.output
    assert isinstance(done.exception, SystemExit), done.exception  # nothing escaped the CLI
    lines = [line for line in done.output.splitlines() if line.startswith(f"  - {path}: ")]
    assert len(lines) == 1, done.output
    assert all(fragment in lines[0] for fragment in fragments), lines[0]
    assert "Traceback" not in done.output and "InternalError" not in done.output


def test_hostile_table_covers_the_issue_and_ten_more() -> None:
    assert len(HOSTILE) >= 10 + 10


@pytest.mark.parametrize(
    ("text", "path", "fragment"),
    [
        (_with("rounds: 3", "rounds: true"), "spec.rounds", "True is a boolean"),
        (_with("kind: MLP", "kind: \ud800"), "<file>", "is not valid Unicode text"),
        (b"\xff\xfe" + VALID.encode("utf-16-le"), "<file>", "is UTF-16 text"),
    ],
    ids=["type", "lone-surrogate", "utf-16-bytes"],
)
def test_load_manifest_refuses_the_same_from_text(
    text: str | bytes, path: str, fragment: str
) -> None:
    # The text path (no file: text or bytes) goes through the same checks.
    with pytest.raises(SpecError) as caught:
        load_manifest("inline.yaml", text=text)

    assert [issue.path for issue in caught.value.issues] == [path]
    assert fragment in caught.value.issues[0].message


def test_billion_laughs_is_refused_after_a_few_nodes() -> None:
    # Prepare
    bomb = _billion_laughs()
    stats = LoadStats()

    # Execute
    with pytest.raises(SpecError):
        load_document(bomb, source="bomb.yaml", stats=stats)

    # Assert: refused at lol5 (its aliases would stand for 10 + 9 * 91 + ... > 10,000 nodes)
    # after composing a few dozen nodes: nothing was expanded
    assert len(bomb.encode()) < 1024
    assert stats.nodes - stats.alias_nodes < 60
    assert stats.alias_nodes <= MAX_ALIAS_NODES
    assert stats.nodes <= MAX_ALIAS_NODES + 100


VALID_VARIANTS = [
    pytest.param(b"\xef\xbb\xbf" + VALID.encode(), id="utf-8-bom"),
    pytest.param(_with("learningRate: 0.1", "learningRate: 1"), id="integer-learningRate"),
    pytest.param(_with("learningRate: 0.1", "learningRate: 1e-1"), id="exponent-float"),
    pytest.param(_with("count: 10", "count: 10.0"), id="whole-float-count"),
    pytest.param(_with("rounds: 3", "rounds: 3\n  backoffLimit: null"), id="null-is-unset"),
    pytest.param(
        _with("name: safety-test", "name: safety-test\n  labels:\n    since: 2024-01-01"),
        id="date-stays-a-string",
    ),
    pytest.param(
        _with(
            "  rounds: 3",
            "  rounds: 3\n  roles:\n    server:\n      resources: &res {requests: {cpu: '1'}}"
            "\n    clients:\n      resources: *res",
        ),
        id="alias-within-budget",
    ),
]


@pytest.mark.parametrize("data", VALID_VARIANTS)
def test_load_manifest_accepts_plain_variants(data: str | bytes) -> None:
    run = load_manifest("variant.yaml", text=data)

    assert run.metadata.name == "safety-test"
    assert run.spec.clients.count == 10
    assert run.spec.training.optimizer.learning_rate in {0.1, 1.0}


def test_whole_floats_are_integers_and_labels_keep_dates_as_text() -> None:
    run = load_manifest(
        "variant.yaml",
        text=_with("count: 10", "count: 10.0").replace(
            "name: safety-test", "name: safety-test\n  labels:\n    since: 2024-01-01"
        ),
    )

    assert run.spec.clients.count == 10 and type(run.spec.clients.count) is int
    assert run.metadata.labels == {"since": "2024-01-01"}


def test_merge_key_merges_and_explicit_keys_win() -> None:
    document = load_document(
        "base: &base {kind: SGD, learningRate: 0.5}\noptimizer:\n  <<: *base\n  learningRate: 1\n",
        source="merge.yaml",
    )

    assert document["optimizer"] == {"kind": "SGD", "learningRate": 1}


# ------------------------------------------------------------------ facts validation relies on


@pytest.mark.parametrize("kind", sorted(BUILTIN_DATASETS))
@pytest.mark.parametrize("test_fraction", [0.2, 0.1, 1 / 3, 0.5, 0.9994])
def test_builtin_dataset_facts_equal_what_the_loader_produces(
    kind: str, test_fraction: float
) -> None:
    # Prepare
    from fedcore.learning.data import load_split
    from fedcore.spec import DataSourceSpec, DataSpec

    facts = BUILTIN_DATASETS[kind]
    data = DataSpec(source=DataSourceSpec(kind=kind), test_fraction=test_fraction)  # type: ignore[arg-type]

    # Execute
    train, test = load_split(data)

    # Assert
    assert (len(train), len(test)) == split_sizes(facts.examples, test_fraction)
    assert len(train) + len(test) == facts.examples
    assert train.num_classes == facts.classes
    assert train.input_shape == facts.input_shape


@pytest.mark.parametrize("clients", [1, 9, 10, 11, 100, 10_000])
def test_longest_object_name_is_the_operators(clients: int) -> None:
    from fedcore_operator import objects

    assert longest_object_name("run", clients) == objects.longest_name("run", clients)


def test_webhook_inherits_the_name_rule() -> None:
    from fedcore_operator import admission

    body = yaml.safe_load(_with("name: safety-test", "name: 9lives"))

    problems = admission.check(body, None, "CREATE")

    assert any(p.startswith("metadata.name: '9lives' is not allowed") for p in problems), problems


def test_npz_folder_too_small_fails_the_run_with_a_data_error(tmp_path: Path) -> None:
    # Prepare: 8 training examples for 20 clients, which only loading the folder can tell
    from fedcore.learning.data import client_dataset

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "pool.npz", x=rng.random((8, 4), dtype=np.float32), y=np.arange(8) % 2)
    np.savez(tmp_path / "test.npz", x=rng.random((4, 4), dtype=np.float32), y=np.arange(4) % 2)
    text = _with("kind: Digits", f"kind: NpzFolder\n      path: {tmp_path}").replace(
        "count: 10", "count: 20"
    )
    run = load_manifest("npz.yaml", text=text)

    # Execute
    with pytest.raises(DataError) as caught:
        client_dataset(run.spec, 0)

    # Assert: a FedcoreError (the CLI prints one line) that is still a ValueError
    assert isinstance(caught.value, FedcoreError) and isinstance(caught.value, ValueError)
    assert "20 clients cannot share 8 training examples" in str(caught.value)


# ------------------------------------------------------------------------------ properties

_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
_TREES = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(
            st.text(string.ascii_letters, min_size=1, max_size=8), children, max_size=4
        ),
    ),
    max_leaves=30,
)
_TOKENS = st.sampled_from(
    [
        "&a ",
        "*a",
        "&b ",
        "*b",
        "<<: ",
        "- ",
        "[",
        "]",
        "{",
        "}",
        ",",
        ": ",
        "? ",
        "\n",
        "  ",
        "---\n",
        "...\n",
        "!!binary ",
        "!!python/name:os.system ",
        "!x ",
        "'",
        '"',
        "#",
        "|\n",
        ">\n",
        "%YAML 1.1\n",
        ".inf",
        ".nan",
        "yes",
        "~",
        "1e9",
        "0x1F",
        "1:30",
        "2024-01-01",
        "\t",
        "\x00",
        "\ufeff",
        "\xe9",
        "rounds",
        "spec",
    ]
)
_YAMLISH = st.lists(st.one_of(_TOKENS, st.text(max_size=6)), max_size=60).map("".join)


def _dump(tree: Any) -> str:
    return yaml.safe_dump(tree, default_flow_style=None, allow_unicode=True)


def _assert_bounded(stats: LoadStats, size: int) -> None:
    """The work a load did, in nodes visited: within the limits and within the input's size."""
    assert stats.nodes <= MAX_NODES
    assert stats.alias_nodes <= MAX_ALIAS_NODES
    assert stats.depth <= MAX_DEPTH
    # every node written out takes at least one byte; the rest is what aliases stand for
    assert stats.nodes - stats.alias_nodes <= size + 1


def _load(data: str | bytes) -> LoadStats:
    """Loads ``data`` as a manifest; only SpecError may come out. Returns what the loader read."""
    stats = LoadStats()
    try:
        load_manifest("generated.yaml", text=data, stats=stats)
    except SpecError as exc:
        assert exc.issues and all(isinstance(issue, SpecIssue) for issue in exc.issues)
        assert all("\n" not in str(issue) for issue in exc.issues)
    return stats


_PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_PROPERTY
@given(_YAMLISH)
def test_yamlish_text_only_ever_raises_spec_error(text: str) -> None:
    stats = _load(text)

    _assert_bounded(stats, len(text.encode("utf-8", "surrogatepass")))


@_PROPERTY
@given(st.binary(max_size=300))
def test_arbitrary_bytes_only_ever_raise_spec_error(data: bytes) -> None:
    stats = _load(data)

    _assert_bounded(stats, len(data))


@_PROPERTY
@given(_TREES)
def test_generated_trees_only_ever_raise_spec_error(tree: Any) -> None:
    text = _dump(tree)

    stats = _load(text)

    _assert_bounded(stats, len(text.encode()))


_MANIFEST_PATHS = st.sampled_from(
    [
        ("spec", "rounds"),
        ("spec", "clients", "count"),
        ("spec", "clients", "perRound"),
        ("spec", "clients", "quorum"),
        ("spec", "training", "optimizer", "learningRate"),
        ("spec", "model", "hidden"),
        ("spec", "model", "bias"),
        ("spec", "data", "testFraction"),
        ("spec", "data", "partition", "minExamples"),
        ("spec", "privacy"),
        ("spec", "roles", "server", "podTemplate"),
        ("metadata", "name"),
        ("metadata", "labels"),
        ("spec",),
    ]
)


def _valid_with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """VALID parsed, with ``value`` set at ``path`` (its missing parents made mappings)."""
    document: dict[str, Any] = yaml.safe_load(VALID)
    parent = document
    for key in path[:-1]:
        parent = parent.setdefault(key, {})
    parent[path[-1]] = value
    return document


@_PROPERTY
@given(_MANIFEST_PATHS, _TREES)
def test_manifest_with_a_generated_field_only_ever_raises_spec_error(
    path: tuple[str, ...], value: Any
) -> None:
    # Prepare
    document = _valid_with(path, value)
    text = _dump(document)

    # Execute
    stats = _load(text)

    # Assert
    _assert_bounded(stats, len(text.encode()))


@_PROPERTY
@given(
    fan_out=st.integers(min_value=1, max_value=30),
    levels=st.integers(min_value=1, max_value=12),
)
def test_alias_towers_are_counted_without_being_expanded(fan_out: int, levels: int) -> None:
    # Prepare: level 0 is a list of fan_out strings; level k holds fan_out aliases of level k-1
    lines = [f"l0: &l0 [{','.join(['x'] * fan_out)}]"]
    for level in range(1, levels + 1):
        lines.append(f"l{level}: &l{level} [{','.join([f'*l{level - 1}'] * fan_out)}]")
    text = "\n".join(lines) + "\n"
    sizes = [1 + fan_out]
    for _ in range(levels):
        sizes.append(1 + fan_out * sizes[-1])
    aliased = sum(fan_out * size for size in sizes[:-1])
    stats = LoadStats()

    # Execute
    try:
        load_document(text, source="tower.yaml", stats=stats)
        refused = False
    except SpecError as exc:
        refused = True
        assert "alias" in exc.issues[0].message

    # Assert: refused exactly when the aliases stand for more than the budget
    assert refused == (aliased > MAX_ALIAS_NODES)
    _assert_bounded(stats, len(text))


@_PROPERTY
@given(_MANIFEST_PATHS, st.recursive(_SCALARS, lambda c: st.lists(c, max_size=3), max_leaves=20))
def test_parse_manifest_of_any_value_only_ever_raises_spec_error(
    path: tuple[str, ...], value: Any
) -> None:
    # Prepare: Python values straight into parse_manifest (the API server's path), NaN included
    document = _valid_with(path, value)

    # Execute and Assert
    try:
        parse_manifest(document, source="generated")
    except SpecError as exc:
        assert exc.issues and all("\n" not in str(issue) for issue in exc.issues)


@pytest.mark.parametrize(("extra", "refused"), [(57, False), (58, True)])
def test_a_parsed_manifest_is_bounded_as_a_loaded_one(extra: int, refused: bool) -> None:
    """The webhook gets its run as JSON from the API server, never through the YAML loader:
    parse_manifest bounds the nesting the same way, at the same depth."""
    # Prepare: lists nested under spec.roles.server.podTemplate.spec.x (a free-form field),
    # the innermost value at depth 7 + extra (the top-level mapping is depth 1).
    nest: Any = "x"
    for _ in range(extra):
        nest = [nest]
    document = yaml.safe_load(VALID)
    document["spec"]["roles"] = {"server": {"podTemplate": {"spec": {"x": nest}}}}
    text = yaml.safe_dump(document)
    # Execute
    verdicts = []
    for judge in (
        lambda: load_manifest("deep.yaml", text=text),
        lambda: parse_manifest(document),
    ):
        try:
            judge()
        except SpecError as exc:
            verdicts.append(str(exc.issues[0]))
        else:
            verdicts.append("")
    # Assert: the same verdict from both, naming where it nests too deep
    assert [bool(v) for v in verdicts] == [refused, refused]
    if refused:
        assert all("spec.roles.server.podTemplate.spec.x[0]" in v for v in verdicts), verdicts
        assert "nests deeper than 64 levels" in verdicts[1]
