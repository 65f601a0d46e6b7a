"""EBS-CFL's key material as the KDC derives it: every matrix from a 32-byte master secret.

The KDC draws one master secret from the OS CSPRNG when the run starts and checkpoints only
that, the server's unit g_0 and the open attempt; every key of an attempt is re-derived from
them on demand, so a restarted KDC serves exactly the keys it served before. Each key has its
own generator: HKDF-SHA256(master, info = a label naming the key, the attempt and the client)
seeds numpy's SFC64. SFC64 is fast and not cryptographic: the KDC draws 4 l m mask numbers per
client per round (ek^1 is as long as an upload), and the scheme's confidentiality is not
cryptographic anyway (digest 004, 3.3, and docs/protocols/ebscfl.md). The masks' entries are
uniform with unit variance (the paper leaves their law open, G17).

Lifetimes (digest 2.12): in Faithful mode the encode and SRFC keys, the score extractor and
mu belong to the roster (fixed while the same clients take part, as in the paper) and only
R'' (hence ek^1 and vk) is fresh every attempt; in Repaired mode every key is fresh every
attempt, so a key the server derives by an attack decodes one attempt only.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedcore.protocols.ebscfl import maths

LABEL = "fedcore/ebscfl/v1"
"""Domain separation of every derivation in this module."""

SCORE_SCALE = (0.5, 2.0)
"""The range of the secret scale c_i of a client's factored score extractor (a_i c_i, P_i/c_i)."""


def generator(master: bytes, *label: Any) -> np.random.Generator:
    """A generator seeded by HKDF-SHA256(master, info=LABEL + label)."""
    info = json.dumps([LABEL, *label], separators=(",", ":")).encode()
    key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(master)
    return np.random.Generator(np.random.SFC64(int.from_bytes(key, "little")))


def uniform_rows(rng: np.random.Generator, rows: int, width: int) -> np.ndarray:
    """rows x width entries uniform on [-sqrt 3, sqrt 3] (mean 0, variance 1), float64.

    Drawn as float32 and widened (exactly): the first k rows of a draw are the k rows a
    shorter draw from the same seed gives.
    """
    values = rng.random(rows * width, dtype=np.float32).astype(np.float64)
    values -= 0.5
    values *= 2 * math.sqrt(3.0)
    return values.reshape(rows, width)


def roster_digest(roster: Sequence[int]) -> str:
    """A short digest naming a roster in derivation labels."""
    return hashlib.sha256(json.dumps(sorted(roster)).encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Attempt:
    """One attempt the server opened at the KDC.

    Attributes:
        round: the round.
        attempt: the attempt of that round, from 1.
        nonce: the server's random tag of the attempt (bound into the masks).
        roster: the participants, ascending; position p is roster[p].
    """

    round: int
    attempt: int
    nonce: str
    roster: tuple[int, ...]

    def as_json(self) -> dict[str, Any]:
        """The attempt as JSON values."""
        return {
            "round": self.round,
            "attempt": self.attempt,
            "nonce": self.nonce,
            "roster": list(self.roster),
        }

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> Attempt:
        """The inverse of ``as_json``."""
        return cls(
            int(value["round"]),
            int(value["attempt"]),
            str(value["nonce"]),
            tuple(int(k) for k in value["roster"]),
        )


@dataclass
class ClientMasks:
    """Client p's masks of an attempt."""

    r: np.ndarray
    mu: np.ndarray
    direction: np.ndarray


@dataclass(frozen=True)
class MaskSummary:
    """What the server's checks need of client p's masks, kept after the masks are dropped.

    Attributes:
        norm: ||delta_i||^2 of an honest upload (1 + ||R''_i||^2 + ||mu_i||^2).
        check: vk_i = V_i sum_k sum_j R''_ijk.
        mix: (Repaired) the weights of the score extractor's two mask parts that make their
            inner product with the masks 0.
    """

    norm: float
    check: float
    mix: tuple[float, float] | None


@dataclass
class KeyMaterial:
    """Every key of one attempt, derived lazily from the master secret.

    Args:
        master: the KDC's 32-byte master secret.
        attempt: the attempt.
        geometry: the attempt's shapes.
        g0_units: the server's unit g_0, one row per cluster (m x l).
        repaired: Repaired mode (G7 repair and fresh keys every attempt).
        zeta_scale: ||Z||_F of the repair.
    """

    master: bytes
    attempt: Attempt
    geometry: maths.Geometry
    g0_units: np.ndarray
    repaired: bool
    zeta_scale: float
    _masks: dict[int, ClientMasks] = field(default_factory=dict, repr=False)
    _summaries: dict[int, MaskSummary] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ labels

    @property
    def _epoch(self) -> tuple[Any, ...]:
        """The label of the keys that live as long as the roster (Faithful) or the attempt."""
        roster = roster_digest(self.attempt.roster)
        geometry = [self.geometry.length, self.geometry.segment, self.geometry.group]
        if self.repaired:
            return ("attempt", self.attempt.round, self.attempt.attempt, self.attempt.nonce, roster)
        return ("roster", roster, *geometry)

    @property
    def _round(self) -> tuple[Any, ...]:
        """The label of the keys refreshed every attempt (R'', V)."""
        return ("masks", self.attempt.round, self.attempt.attempt, self.attempt.nonce)

    # --------------------------------------------------------------------- keys

    @cached_property
    def embedding(self) -> np.ndarray:
        """A: the cluster embedding (d x d), fixed for the run."""
        return maths.orthogonal(
            generator(self.master, "A", self.geometry.clusters, self.geometry.segment),
            self.geometry.width,
        )

    @cached_property
    def srfc(self) -> maths.SrfcKeys:
        """The SRFC keys of the roster (Eq. 6)."""
        g = self.geometry
        return maths.srfc_keys(
            generator(self.master, "srfc", *self._epoch),
            clients=g.clients,
            width=g.width,
            bound=math.sqrt(g.clusters),
            zeta_sum_scale=self.zeta_scale if self.repaired else 0.0,
        )

    def space(self, group: int) -> np.ndarray:
        """The encode space of ``group`` (3d*xi square)."""
        cached = self._spaces.get(group)
        if cached is None:
            g = self.geometry
            cached = maths.encode_space(
                generator(self.master, "space", group, *self._epoch), g.width, g.group_size(group)
            )
            self._spaces[group] = cached
        return cached

    @cached_property
    def _spaces(self) -> dict[int, np.ndarray]:
        return {}

    @cached_property
    def g0_rows(self) -> np.ndarray:
        """The unit g_0 of every cluster as s x d segment rows."""
        return maths.cluster_rows(self.g0_units, self.geometry)

    def _draws(self, position: int, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(R''_p, mu_p), or their first ``rows`` segments: scaled X_p - X_{p+1 mod n}, so
        that the masks of the n clients sum to zero."""
        g = self.geometry
        n = g.clients
        rows = g.segments if rows is None else rows
        if n == 1:
            return np.zeros((rows, g.width)), np.zeros((rows, g.width))
        following = (position + 1) % n
        r_scale, mu_scale = maths.mask_scales(g)
        mu_label = self._round if self.repaired else self._epoch

        def draw(kind: str, label: tuple[Any, ...], at: int) -> np.ndarray:
            return uniform_rows(generator(self.master, kind, at, *label), rows, g.width)

        r = draw("R''", self._round, position)
        r -= draw("R''", self._round, following)
        r *= r_scale
        mu = draw("mu", mu_label, position)
        mu -= draw("mu", mu_label, following)
        mu *= mu_scale
        return r, mu

    def masks(self, position: int) -> ClientMasks:
        """Client ``position``'s R'', mu and V (it keeps the last client's only: O(l m))."""
        found = self._masks.get(position)
        if found is not None:
            return found
        r, mu = self._draws(position)
        direction = self.directions([position])[0]
        found = ClientMasks(r=r, mu=mu, direction=direction)
        self._masks = {position: found}
        if position not in self._summaries:
            mix = self._score_mix(position, found) if self.repaired else None
            self._summaries[position] = MaskSummary(
                norm=1.0 + float(np.vdot(r, r)) + float(np.vdot(mu, mu)),
                check=maths.verification_value(direction, r, self.geometry.segment),
                mix=mix,
            )
        return found

    def summary(self, position: int) -> MaskSummary:
        """Client ``position``'s check values (drawing its masks if not drawn yet)."""
        if position not in self._summaries:
            self.masks(position)
        return self._summaries[position]

    def directions(self, positions: Sequence[int]) -> list[np.ndarray]:
        """V of each position (cheap: t numbers each)."""
        g = self.geometry
        return [
            generator(self.master, "V", p, *self._round).standard_normal(g.segment)
            for p in positions
        ]

    def members(self, group: int) -> list[int]:
        """The positions in ``group``."""
        start = group * self.geometry.group
        return list(range(start, start + self.geometry.group_size(group)))

    # ------------------------------------------------------- what parties receive

    def client_keys(self, position: int) -> dict[str, np.ndarray]:
        """ek^0 (the client's slot M'_p), A, and ek^1 of this attempt: all a client gets."""
        g = self.geometry
        group, member = g.place(position)
        space = self.space(group)
        size = g.group_size(group)
        masks = self.masks(position)
        return {
            "slot": maths.slot(space, g.width, member).copy(),
            "embedding": self.embedding,
            "mask_key": maths.mask_key(
                masks.r, masks.mu, self.embedding, space, g.width, size, member
            ),
        }

    def server_keys(self) -> dict[str, np.ndarray]:
        """A, beta, tau1-3, dk and vk_0 of every group (concatenated by columns)."""
        g = self.geometry
        srfc = self.srfc
        decode = []
        verify = []
        for group in range(g.groups):
            members = self.members(group)
            space = self.space(group)
            decode.append(maths.decode_key(srfc, space, members, g.width))
            verify.append(
                maths.verification_key(
                    self.directions(members), self.embedding, space, g.width, len(members)
                )
            )
        return {
            "embedding": self.embedding,
            "beta": srfc.beta,
            "tau1": srfc.tau1,
            "tau2": srfc.tau2,
            "tau3": srfc.tau3,
            "decode": np.concatenate(decode, axis=1),
            "verify": np.concatenate(verify),
        }

    @cached_property
    def g0_embedded(self) -> np.ndarray:
        """G0 A: the unit g_0 rows embedded in the clusters' blocks (s x d)."""
        return self.g0_rows @ self.embedding

    def _score_parts(self, position: int) -> tuple[np.ndarray, np.ndarray]:
        rng = generator(self.master, "score-mask", position, *self._epoch)
        return maths.score_mask_parts(self.g0_embedded, rng)

    def _score_mix(self, position: int, masks: ClientMasks) -> tuple[float, float]:
        u, v = self._score_parts(position)
        return maths.score_mask_mix(masks.r @ self.embedding, masks.mu, u, v)

    def score_keys(self, position: int) -> tuple[dict[str, np.ndarray], float, float]:
        """Client ``position``'s factored score extractor (a c, b c', P/c, Q/c') and its norm
        and mask-check values: what the server needs to check and score that client.

        alpha'_i = a_i (x) P_i + b_i (x) Q_i is a rank-2 tensor, so its factors reveal nothing
        its sum does not (up to their scales, which c and c' hide). In Repaired mode a_i is
        masked in its mask slots (``maths.masked_score_extractor``: leak 4's repair).
        """
        g = self.geometry
        group, member = g.place(position)
        space = self.space(group)
        size = g.group_size(group)
        summary = self.summary(position)
        cached = self._masks.get(position)
        mu_first = cached.mu[0] if cached is not None else self._draws(position, rows=1)[1][0]
        a, b = maths.score_extractor(
            self.g0_rows, self.embedding, mu_first, space, g.width, size, member
        )
        p, q = self.srfc.score_matrices(position)
        if self.repaired:
            assert summary.mix is not None
            a = maths.masked_score_extractor(
                a,
                self._score_parts(position),
                summary.mix,
                maths.slot(space, g.width, member + size),
                maths.slot(space, g.width, member + 2 * size),
            )
        scales = generator(self.master, "score-scale", position, *self._epoch)
        low, high = SCORE_SCALE
        c_a, c_b = scales.uniform(low, high, 2) * scales.choice([-1.0, 1.0], 2)
        keys = {"a": a * c_a, "b": b * c_b, "p": p / c_a, "q": q / c_b}
        return keys, summary.norm, summary.check
