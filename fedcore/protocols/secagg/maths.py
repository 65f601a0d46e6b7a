"""SecAgg+ maths: Shamir sharing, the sharing graph, degree and threshold, fixed point, masks.

Each client u quantizes its update onto ``[0, levels - 1]`` (``quantize``) and uploads
``y_u = x_u + PRG(b_u) + sum_v +-PRG(s_uv) mod 2^bits`` (``mask_input``): ``b_u`` is a fresh
self-mask seed, ``s_uv`` the seed it agrees with each neighbour v on the sharing graph (u adds
the pair's mask when u < v, subtracts it otherwise, so pair masks cancel in the sum). u
Shamir-shares ``b_u`` and its mask private key among its neighbours with threshold t
(``split_secret``). The server sums the uploads that arrived; for each survivor it
reconstructs ``b_u`` from t neighbours' shares and for each neighbour d of a survivor whose
upload never arrived it reconstructs d's mask key, hence ``s_ud`` (``combine_shares``), and
removes those masks (``unmask_sum``); ``dequantize_sum`` turns the integer sum back into
floats. The sharing graph is a Harary graph over a permutation drawn from a public seed
(``sharing_graph``), so a node's neighbours are a uniformly random subset of the others, and
``choose_parameters`` picks the least degree and threshold whose exact failure probabilities
(``failure_probabilities``) meet the run's bounds. Secrets come from the OS CSPRNG only; the
masks' PRG is mpdp's AES-256-CTR keystream.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedcore.errors import ProtocolError
from fedcore.protocols.mpdp.keys import keystream, keystreams
from fedcore.spec._options.secagg import (  # re-exported: the protocol's parameter maths
    choose_parameters as choose_parameters,
)
from fedcore.spec._options.secagg import (
    failure_probabilities as failure_probabilities,
)

PROTOCOL_LABEL = "fedcore/secagg/v1"
"""Domain separation of every derivation in SecAgg+ (this module and ``keys``)."""

FIELD_PRIME = 2**521 - 1
"""The Shamir field: the Mersenne prime 2^521 - 1, so any 32-byte secret is one element."""

SECRET_BYTES = 32
"""The size of a shared secret (a self-mask seed or an X25519 private key)."""

SHARE_BYTES = (FIELD_PRIME.bit_length() + 7) // 8
"""The size of a share: a field element, big-endian, fixed width (66 bytes)."""

SEED_BYTES = 32
"""The size of a mask seed and of the graph's public seed."""

MAX_BITS = 62
"""The widest mask modulus, 2^62: sums and masks live in uint64 with room to spare."""

STREAM_SELF_MASK = 1
"""The keystream of a client's self mask (keyed by its seed b_u)."""
STREAM_PAIR_MASK = 2
"""The keystream of a pair's mask (keyed by the pair seed s_uv)."""
STREAM_GRAPH = 3
"""The keystream that draws the sharing graph's permutation (keyed from the public seed)."""

_WORD = 2**64
_GRAPH_CHUNK = 256
"""Words of graph keystream fetched at a time (even: AES blocks hold two words)."""

Vector = npt.NDArray[np.uint64]


# ------------------------------------------------------------------------------ Shamir


def split_secret(secret: bytes, threshold: int, holders: Sequence[int]) -> dict[int, bytes]:
    """Shamir-shares a 32-byte secret among ``holders`` so any ``threshold`` of them recover it.

    The polynomial has the secret as constant term and ``threshold - 1`` coefficients drawn
    uniformly from the field with ``secrets.randbelow``; holder i gets its value at x = i + 1.
    Any ``threshold - 1`` shares are independent of the secret.

    Args:
        secret: the 32 secret bytes (read as a big-endian integer).
        threshold: how many shares reconstruct it, 1 to ``len(holders)``.
        holders: the distinct non-negative client indices that get a share.

    Returns:
        Each holder's share, ``SHARE_BYTES`` big-endian bytes.

    Raises:
        ProtocolError: the secret is not 32 bytes, the holders are not distinct non-negative
            integers, or the threshold is out of range.
    """
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        raise ProtocolError(f"A shared secret has {SECRET_BYTES} bytes.")
    members = _check_holders(holders)
    _check_threshold(threshold, len(members))
    coefficients = [int.from_bytes(secret, "big")]
    coefficients += [secrets.randbelow(FIELD_PRIME) for _ in range(threshold - 1)]
    shares: dict[int, bytes] = {}
    for holder in members:
        x = holder + 1
        value = 0
        for coefficient in reversed(coefficients):
            value = (value * x + coefficient) % FIELD_PRIME
        shares[holder] = value.to_bytes(SHARE_BYTES, "big")
    return shares


def combine_shares(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """Recovers a secret from ``threshold`` or more Shamir shares (Lagrange interpolation at 0).

    With more than ``threshold`` shares, all of them must lie on the one polynomial of degree
    ``threshold - 1`` through the ``threshold`` lowest holders' shares. With any number of
    shares the value at 0 must be a 32-byte secret, which a random false share breaks with
    probability 1 - 2^-265; a share shifted on purpose (which moves the secret by a multiple
    of its Lagrange coefficient) passes it, so with exactly ``threshold`` shares the result
    is checked only where the caller has a commitment (e.g. a mask key against its public
    key, ``keys.private_from_bytes``). Neither check can say who lied: errors name holders.

    Args:
        shares: share bytes by holder (client index; the share is the value at index + 1).
        threshold: the threshold the secret was split with.

    Returns:
        The 32-byte secret.

    Raises:
        ProtocolError: fewer than ``threshold`` shares; a holder index or share that is
            malformed (wrong type or width, not a field element); shares that do not lie on
            one polynomial of degree ``threshold - 1`` or whose secret is not 32 bytes.
    """
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ProtocolError(f"A Shamir threshold is a positive integer, not {threshold!r}.")
    points: dict[int, int] = {}
    for holder, share in shares.items():
        if isinstance(holder, bool) or not isinstance(holder, int) or holder < 0:
            raise ProtocolError(f"A share's holder must be a client index, not {holder!r}.")
        if not isinstance(share, bytes) or len(share) != SHARE_BYTES:
            raise ProtocolError(
                f"The share of holder {holder} is not {SHARE_BYTES} bytes; it is malformed."
            )
        value = int.from_bytes(share, "big")
        if value >= FIELD_PRIME:
            raise ProtocolError(f"The share of holder {holder} is not a field element.")
        points[holder] = value
    if len(points) < threshold:
        raise ProtocolError(
            f"Reconstruction needs {threshold} shares, got {len(points)} (holders "
            f"{sorted(points)})."
        )
    holders = sorted(points)
    base = holders[:threshold]
    xs = [h + 1 for h in base]
    ys = [points[h] for h in base]
    weights = _lagrange_weights(xs)
    disagree = [h for h in holders[threshold:] if _evaluate(xs, ys, weights, h + 1) != points[h]]
    if disagree:
        raise ProtocolError(
            f"The shares of holders {holders} do not lie on one polynomial of degree "
            f"{threshold - 1}: holders {disagree} disagree with the one through holders {base}; "
            "some share is false."
        )
    secret = _evaluate(xs, ys, weights, 0)
    if secret >= 2 ** (8 * SECRET_BYTES):
        raise ProtocolError(
            f"The shares of holders {holders} do not reconstruct a {SECRET_BYTES}-byte secret; "
            "some share is false."
        )
    return secret.to_bytes(SECRET_BYTES, "big")


def _check_holders(holders: Sequence[int]) -> list[int]:
    """The holders as a list, checked: distinct non-negative integers, at least one."""
    members = list(holders)
    for holder in members:
        if isinstance(holder, bool) or not isinstance(holder, int) or holder < 0:
            raise ProtocolError(f"A share holder must be a client index >= 0, not {holder!r}.")
    if not members:
        raise ProtocolError("A secret is shared among one holder or more, got none.")
    if len(set(members)) != len(members):
        raise ProtocolError(f"The share holders {sorted(members)} are not distinct.")
    return members


def _check_threshold(threshold: int, holders: int) -> None:
    if isinstance(threshold, bool) or not isinstance(threshold, int):
        raise ProtocolError(f"A Shamir threshold is an integer, not {threshold!r}.")
    if not 1 <= threshold <= holders:
        raise ProtocolError(
            f"A Shamir threshold lies in 1 to the number of holders ({holders}), not {threshold}."
        )


def _lagrange_weights(xs: Sequence[int]) -> list[int]:
    """The barycentric weights 1 / prod_{j != i} (x_i - x_j) mod p of distinct points."""
    weights = []
    for i, xi in enumerate(xs):
        denominator = 1
        for j, xj in enumerate(xs):
            if j != i:
                denominator = denominator * (xi - xj) % FIELD_PRIME
        weights.append(pow(denominator, -1, FIELD_PRIME))
    return weights


def _evaluate(xs: Sequence[int], ys: Sequence[int], weights: Sequence[int], z: int) -> int:
    """The interpolating polynomial of (xs, ys) at z: sum y_i w_i prod_{j != i} (z - x_j)."""
    count = len(xs)
    prefix = [1] * (count + 1)
    for i, x in enumerate(xs):
        prefix[i + 1] = prefix[i] * (z - x) % FIELD_PRIME
    total = 0
    suffix = 1
    for i in range(count - 1, -1, -1):
        total += ys[i] * weights[i] % FIELD_PRIME * prefix[i] % FIELD_PRIME * suffix
        suffix = suffix * (z - xs[i]) % FIELD_PRIME
    return total % FIELD_PRIME


# ------------------------------------------------------------------------------ the graph


def sharing_graph(clients: Sequence[int], degree: int, seed: bytes) -> dict[int, tuple[int, ...]]:
    """Each client's neighbours on the round's sharing graph, drawn from a public seed.

    The clients (sorted) are shuffled by Fisher-Yates, each index drawn without bias from
    AES-256-CTR words keyed by HKDF of ``seed`` (rejection sampling), and placed on a cycle
    in that order; each is joined to the ``degree / 2`` nearest on either side: the Harary
    graph H(degree, n). Every party computes the same graph from the same seed and set. When
    ``degree >= n - 1`` the graph is complete. Odd degrees below ``n - 1`` are refused: the
    odd Harary graph is not regular for odd n and its neighbourhoods are not uniform subsets.

    Args:
        clients: the distinct non-negative client indices.
        degree: each client's number of neighbours: even, or at least ``n - 1``.
        seed: 32 public bytes, fresh each round (e.g. from the round's commitments).

    Returns:
        Each client's neighbours, sorted; the graph is symmetric and has no self-loops.

    Raises:
        ProtocolError: the clients are not distinct non-negative integers, the seed is not
            32 bytes, or the degree is not positive or odd below ``n - 1``.
    """
    members = sorted(_check_holders(clients)) if len(clients) else []
    count = len(members)
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ProtocolError(f"The sharing graph's degree is a positive integer, not {degree!r}.")
    if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
        raise ProtocolError(f"The sharing graph's seed has {SEED_BYTES} bytes.")
    if degree >= count - 1:
        return {k: tuple(v for v in members if v != k) for k in members}
    if degree % 2:
        raise ProtocolError(
            f"The sharing graph's degree must be even below n - 1 = {count - 1}, not {degree}."
        )
    order = _permutation(seed, members)
    neighbours: dict[int, set[int]] = {k: set() for k in members}
    for position, k in enumerate(order):
        for step in range(1, degree // 2 + 1):
            neighbours[k].add(order[(position + step) % count])
            neighbours[k].add(order[(position - step) % count])
    return {k: tuple(sorted(vs)) for k, vs in neighbours.items()}


def _permutation(seed: bytes, members: Sequence[int]) -> list[int]:
    """``members`` shuffled by Fisher-Yates with unbiased draws from the seed's keystream."""
    key = HKDF(
        algorithm=hashes.SHA256(),
        length=SEED_BYTES,
        salt=None,
        info=f"{PROTOCOL_LABEL} sharing-graph".encode(),
    ).derive(seed)
    words = _words(key, STREAM_GRAPH)
    order = list(members)
    for i in range(len(order) - 1, 0, -1):
        j = _below(words, i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def _words(key: bytes, stream: int) -> Iterator[int]:
    """The keystream's uint64 words, one at a time, for as long as the caller draws."""
    offset = 0
    while True:
        yield from keystreams([(key, stream)], _GRAPH_CHUNK, offset=offset)[0].tolist()
        offset += _GRAPH_CHUNK


def _below(words: Iterator[int], bound: int) -> int:
    """A uniform integer in [0, bound): words at or above the last multiple of bound are
    rejected, so no residue is likelier than another."""
    limit = _WORD - _WORD % bound
    while True:
        word = next(words)
        if word < limit:
            return word % bound


def needed_edges(
    graph: Mapping[int, Sequence[int]], survivors: Collection[int], dropped: Collection[int]
) -> set[tuple[int, int]]:
    """The edges whose pair seeds the server must reconstruct to unmask the sum.

    A survivor's upload carries the pair mask of every neighbour it masked with; those of two
    survivors cancel in the sum, those of a survivor u and a neighbour d whose upload never
    arrived do not. So the server needs ``s_ud`` for each such (u, d), from d's mask key
    reconstructed from d's shares (and never a survivor's mask key, nor a dropped client's
    self seed).

    Args:
        graph: each client's neighbours, as the clients masked with them.
        survivors: the clients whose masked input arrived.
        dropped: the graph's clients whose masked input never arrived.

    Returns:
        The edges as (survivor, dropped neighbour).
    """
    gone = set(dropped)
    return {(u, d) for u in survivors for d in graph.get(u, ()) if d in gone}


# ------------------------------------------------------------------------------ fixed point


@dataclass(frozen=True)
class Quantization:
    """A fixed-point encoding: values clipped to [-clip, clip] map onto [0, levels - 1].

    Attributes:
        clip: the bound of the values, positive and finite.
        levels: how many integer levels, at least 2 (the step is 2 clip / (levels - 1)).
        bits: the masks' modulus is 2^bits, 1 to 62; ``choose_bits`` picks it so a sum of
            the clients' values never wraps.

    Raises:
        ProtocolError: a field is out of range, or one value's top level does not fit in bits.
    """

    clip: float
    levels: int
    bits: int

    def __post_init__(self) -> None:
        if isinstance(self.clip, bool) or not isinstance(self.clip, int | float):
            raise ProtocolError(f"The clip is a number, not {self.clip!r}.")
        if not math.isfinite(self.clip) or self.clip <= 0:
            raise ProtocolError(f"The clip is positive and finite, not {self.clip!r}.")
        if isinstance(self.levels, bool) or not isinstance(self.levels, int) or self.levels < 2:
            raise ProtocolError(f"The levels are an integer of 2 or more, not {self.levels!r}.")
        _check_bits(self.bits)
        if self.levels - 1 >= 2**self.bits:
            raise ProtocolError(
                f"{self.levels} levels do not fit in {self.bits} bits; use choose_bits."
            )


def choose_bits(clients: int, levels: int) -> int:
    """The least bits so that ``clients`` values in [0, levels - 1] sum without wrapping.

    That is the least b with clients * (levels - 1) < 2^b.

    Raises:
        ProtocolError: an argument is out of range, or the sum needs more than 62 bits.
    """
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ProtocolError(f"The client count is a positive integer, not {clients!r}.")
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 2:
        raise ProtocolError(f"The levels are an integer of 2 or more, not {levels!r}.")
    bits = max(1, (clients * (levels - 1)).bit_length())
    if bits > MAX_BITS:
        raise ProtocolError(
            f"A sum of {clients} values of {levels} levels needs {bits} bits, more than "
            f"{MAX_BITS}; use fewer levels."
        )
    return bits


def quantize(
    values: npt.NDArray[Any],
    q: Quantization,
    *,
    stochastic: bool,
    rng: np.random.Generator | None = None,
) -> Vector:
    """Encodes values as integers in [0, levels - 1], same shape.

    A value is clipped to [-clip, clip] and mapped linearly, -clip to 0 and clip to
    levels - 1, then rounded to the nearest level (error at most clip / (levels - 1)) or, when
    ``stochastic``, up with probability equal to its fractional part (unbiased), drawing from
    ``rng``.

    Raises:
        ProtocolError: the values are not a real array or some are not finite, or
            ``stochastic`` without an ``rng``.
    """
    array = np.asarray(values)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise ProtocolError(f"Only real values are quantized, not {array.dtype}.")
    array = array.astype(np.float64)
    bad = ~np.isfinite(array)
    if bad.any():
        raise ProtocolError(
            f"{int(bad.sum())} values to quantize are not finite (first at flat index "
            f"{int(np.flatnonzero(bad)[0])})."
        )
    top = q.levels - 1
    scaled = (np.clip(array, -q.clip, q.clip) + q.clip) * top / (2 * q.clip)
    if stochastic:
        if rng is None:
            raise ProtocolError("Stochastic rounding needs a random generator.")
        floor = np.floor(scaled)
        rounded = floor + (rng.random(scaled.shape) < scaled - floor)
    else:
        rounded = np.rint(scaled)
    levels = np.clip(rounded, 0, None).astype(np.uint64)
    return np.minimum(levels, np.uint64(top))


def dequantize_sum(total: Vector, count: int, q: Quantization) -> npt.NDArray[np.float64]:
    """The float sum of ``count`` clients' values from the sum of their levels.

    Each level l stands for l * 2 clip / (levels - 1) - clip, so the sum is
    total * 2 clip / (levels - 1) - count * clip (exact up to float64 rounding).

    Raises:
        ProtocolError: ``total`` is not a uint64 array, ``count`` is negative, or some
            coordinate exceeds count * (levels - 1) (the sum wrapped or the count is wrong).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ProtocolError(f"The client count is a non-negative integer, not {count!r}.")
    if not isinstance(total, np.ndarray) or total.dtype != np.uint64:
        raise ProtocolError("A quantized sum is a uint64 array.")
    ceiling = count * (q.levels - 1)
    if total.size and int(total.max()) > ceiling:
        raise ProtocolError(
            f"A quantized sum of {count} clients reaches {int(total.max())}, above "
            f"{ceiling}: it wrapped or the count is wrong."
        )
    return total.astype(np.float64) * (2 * q.clip) / (q.levels - 1) - count * q.clip


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ProtocolError(f"The mask bits lie in 1 to {MAX_BITS}, not {bits!r}.")


# ------------------------------------------------------------------------------ masks


def expand_mask(seed: bytes, size: int, bits: int, stream: int) -> Vector:
    """``size`` mask words in [0, 2^bits): AES-256-CTR words of ``seed`` with the top bits cut.

    2^bits divides 2^64, so the low bits of a uniform word are uniform mod 2^bits.

    Raises:
        ProtocolError: the seed is not 32 bytes, the size is negative or the bits out of range.
    """
    if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
        raise ProtocolError(f"A mask seed has {SEED_BYTES} bytes.")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ProtocolError(f"A mask's size is a non-negative integer, not {size!r}.")
    _check_bits(bits)
    return keystream(seed, stream, size) & np.uint64(2**bits - 1)


def mask_input(
    quantized: Vector,
    *,
    client: int,
    self_seed: bytes,
    pair_seeds: Mapping[int, bytes],
    bits: int,
) -> Vector:
    """A client's upload: y = x + PRG(b) + sum_v (+PRG(s_uv) if client < v else -PRG(s_uv)).

    All mod 2^bits, in uint64 (which wraps mod 2^64, a multiple of 2^bits).

    Args:
        quantized: the client's levels, a uint64 array (any shape) below 2^bits.
        client: the client's index.
        self_seed: its fresh self-mask seed b.
        pair_seeds: the seed s_uv it shares with each neighbour v it masks with.
        bits: the modulus is 2^bits.

    Returns:
        The masked input, same shape.

    Raises:
        ProtocolError: the input is not uint64 below 2^bits, a seed is not 32 bytes, or the
            client is its own neighbour.
    """
    _check_bits(bits)
    _check_vector(quantized, bits, what=f"client {client}'s quantized input")
    if client in pair_seeds:
        raise ProtocolError(f"Client {client} cannot share a pair mask with itself.")
    size = quantized.size
    masked = quantized.reshape(-1) + expand_mask(self_seed, size, bits, STREAM_SELF_MASK)
    for v in sorted(pair_seeds):
        mask = expand_mask(pair_seeds[v], size, bits, STREAM_PAIR_MASK)
        (np.add if client < v else np.subtract)(masked, mask, out=masked)
    np.bitwise_and(masked, np.uint64(2**bits - 1), out=masked)
    return masked.reshape(quantized.shape)


def unmask_sum(
    masked: Mapping[int, Vector],
    *,
    graph: Mapping[int, Sequence[int]],
    self_seeds: Mapping[int, bytes],
    dropped_pair_seeds: Mapping[tuple[int, int], bytes],
    bits: int,
) -> Vector:
    """The sum mod 2^bits of the survivors' quantized inputs, from their masked inputs.

    The survivors are the clients in ``masked``; the dropped ones are the other clients of
    ``graph`` (which must be the graph the clients masked with: each client's neighbours
    restricted to those it masked with). The caller passes each survivor's self seed b_u and,
    for every edge ``needed_edges(graph, survivors, dropped)`` (survivor u, dropped d), the
    pair seed s_ud rebuilt from d's mask key; this removes sum_u PRG(b_u) and each
    unmatched pair mask (u added +PRG(s_ud) when u < d, -PRG(s_ud) otherwise).

    Raises:
        ProtocolError: a masked input is not a uint64 array below 2^bits of the common shape
            (naming the client); a survivor is not on the graph; a survivor's self seed or a
            needed edge's seed is missing; or a self seed of a dropped client, or the seed of an
            edge that is not needed, is given (the server must never rebuild those).
    """
    _check_bits(bits)
    survivors = set(masked)
    if not survivors:
        raise ProtocolError("No masked input arrived; there is nothing to unmask.")
    off_graph = sorted(survivors - set(graph))
    if off_graph:
        raise ProtocolError(f"Clients {off_graph} sent masked inputs but are not on the graph.")
    shapes = set()
    for client in sorted(survivors):
        _check_vector(masked[client], bits, what=f"client {client}'s masked input")
        shapes.add(masked[client].shape)
    if len(shapes) > 1:
        raise ProtocolError(f"The masked inputs have different shapes: {sorted(shapes)}.")
    missing = sorted(survivors - set(self_seeds))
    if missing:
        raise ProtocolError(f"The self seeds of survivors {missing} are missing.")
    extra = sorted(set(self_seeds) - survivors)
    if extra:
        raise ProtocolError(
            f"Self seeds of clients {extra} were given, but their masked inputs never arrived; "
            "a dropped client's self seed must never be rebuilt."
        )
    needed = needed_edges(graph, survivors, set(graph) - survivors)
    missing_edges = sorted(needed - set(dropped_pair_seeds))
    if missing_edges:
        raise ProtocolError(f"The pair seeds of edges {missing_edges} are missing.")
    extra_edges = sorted(set(dropped_pair_seeds) - needed)
    if extra_edges:
        raise ProtocolError(
            f"Pair seeds of edges {extra_edges} were given, but they are not edges from a "
            "survivor to a dropped neighbour."
        )
    shape = shapes.pop()
    size = math.prod(shape)
    total = np.zeros(size, dtype=np.uint64)
    for client in sorted(survivors):
        np.add(total, masked[client].reshape(-1), out=total)
        np.subtract(total, expand_mask(self_seeds[client], size, bits, STREAM_SELF_MASK), out=total)
    for u, d in sorted(needed):
        mask = expand_mask(dropped_pair_seeds[(u, d)], size, bits, STREAM_PAIR_MASK)
        (np.subtract if u < d else np.add)(total, mask, out=total)
    np.bitwise_and(total, np.uint64(2**bits - 1), out=total)
    return total.reshape(shape)


def _check_vector(vector: object, bits: int, *, what: str) -> None:
    """Checks an array is uint64 with every word below 2^bits."""
    if not isinstance(vector, np.ndarray) or vector.dtype != np.uint64:
        raise ProtocolError(f"The {what} is not a uint64 array.")
    if vector.size and int(vector.max()) >= 2**bits:
        raise ProtocolError(f"The {what} has words of {bits} bits or more.")
