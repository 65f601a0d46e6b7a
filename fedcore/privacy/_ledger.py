"""The privacy ledger: one accountant step per round, and the budget's stop (server role and
simulation alike)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedcore.observe.metrics import RoleMetrics
from fedcore.privacy._accountant import create_accountant
from fedcore.privacy.sampling import sampling_rate
from fedcore.spec import FederatedRunSpec

_STATUS_NAMES = {"add-remove": "AddRemove", "replace-one": "ReplaceOne"}
"""``PrivacyLedger.adjacency`` as the status and final JSON spell it."""


class PrivacyLedger:
    """Steps the run's accountant once per round for protocols that claim DP.

    What a round is accounted as, so that the epsilon reported (and the budget's stop) is a
    proven bound for the mechanism fedcore runs:

    - Every client every round (``perRound`` 100%): one Gaussian mechanism of the protocol's
      multiplier z, exact under add/remove adjacency (one client's data added or removed).
    - Fewer clients per round, under replace-one adjacency (one client's data replaced): a
      round moves the clipped sum by at most twice the clipping bound when that client is
      sampled and not at all otherwise, so a round is a Gaussian mechanism of multiplier z/2
      on the sampled clients.
    - ``Seeded`` sampling (the default): fedcore samples a fixed number of clients from a
      generator seeded by the manifest, so the sample is public and amplification by
      subsampling (which needs the adversary not to know who took part) cannot be claimed:
      each round is accounted as that Gaussian with no sampling, the worst case of a client
      sampled every round. The sampling then spares compute, not privacy.
    - ``Secret`` sampling: the server draws the fixed number m of the N clients from the OS
      CSPRNG, so each round is that Gaussian on a uniformly random sample without
      replacement of rate m/N, whose amplification (Wang, Balle and Kasiviswanathan 2019,
      replace-one adjacency) dp-accounting's RDP accountant composes.

    Args:
        spec: the run's spec (privacy block, client sampling).
        noise_multiplier: the protocol's per-round Gaussian noise multiplier z, relative to one
            client's contribution bound; None when the protocol claims no DP (the ledger then
            does nothing).
        metrics: where epsilon and the budget are exported (None: nowhere).
    """

    def __init__(
        self,
        spec: FederatedRunSpec,
        noise_multiplier: float | None,
        metrics: RoleMetrics | None = None,
    ) -> None:
        privacy = spec.privacy
        self.noise_multiplier = noise_multiplier
        rate = sampling_rate(spec.clients)
        self.sampled = rate < 1
        """Whether rounds take part of the clients (accounted under replace-one adjacency)."""
        self.secret = self.sampled and spec.clients.sampling == "Secret"
        """Whether the sample is secret, so that its amplification is claimed."""
        self.round_rate = rate if self.secret else 1.0
        """The sampling rate each round is accounted with (1: no amplification claimed)."""
        self.delta = privacy.target_delta if privacy else 1e-5
        self.target = privacy.target_epsilon if privacy else None
        self.accountant = create_accountant(
            privacy.accountant if privacy else "RDP",
            "without-replacement" if self.secret else "poisson",
        )
        self.metrics = metrics
        self._next: float | None = None
        """Epsilon after one more round, computed by the budget check and reused after it."""
        self._spent: float | None = None
        if metrics is not None and self.enabled and self.target is not None:
            metrics.epsilon_budget.set(self.target)

    @property
    def adjacency(self) -> str:
        """The neighbouring relation the reported epsilon holds under."""
        return "replace-one" if self.sampled else "add-remove"

    @property
    def round_multiplier(self) -> float | None:
        """The multiplier of the Gaussian mechanism each round is accounted as."""
        if self.noise_multiplier is None:
            return None
        return self.noise_multiplier / 2 if self.sampled else self.noise_multiplier

    def claim(self) -> dict[str, str]:
        """What the reported epsilon is a bound of, for events, status and the final JSON.

        ``adjacency``: ``AddRemove`` (one client's data added or removed) or ``ReplaceOne``
        (replaced); ``amplification``: ``None`` or ``SamplingWithoutReplacement`` (a secret
        sample). Empty without DP.
        """
        if not self.enabled:
            return {}
        return {
            "adjacency": _STATUS_NAMES[self.adjacency],
            "amplification": "SamplingWithoutReplacement" if self.secret else "None",
        }

    @property
    def enabled(self) -> bool:
        """Whether the protocol claims DP, so that rounds are accounted."""
        return self.noise_multiplier is not None

    def next_round_exceeds(self) -> float | None:
        """Returns the epsilon one more round would reach if that passes the budget, else None."""
        if not self.enabled or self.target is None:
            return None
        assert self.round_multiplier is not None
        after = self.accountant.epsilon_after(
            self.delta, noise_multiplier=self.round_multiplier, sample_rate=self.round_rate
        )
        self._next = after
        return after if after > self.target else None

    def record_round(self) -> float | None:
        """Accounts one round; returns the epsilon spent so far (None without DP)."""
        if not self.enabled:
            return None
        assert self.round_multiplier is not None
        self.accountant.step(noise_multiplier=self.round_multiplier, sample_rate=self.round_rate)
        # The budget check already computed this round's epsilon (when a budget is set).
        self._spent, self._next = self._next, None
        return self.epsilon()

    def epsilon(self) -> float | None:
        """The epsilon spent so far at the run's delta (None without DP)."""
        if not self.enabled:
            return None
        if self._spent is None:
            self._spent = self.accountant.get_epsilon(self.delta)
        if self.metrics is not None:
            self.metrics.epsilon.set(self._spent)
        return self._spent

    def state_dict(self) -> dict[str, Any]:
        """The accountant's state, for checkpoints."""
        return self.accountant.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the accountant from a checkpoint.

        A checkpoint written before rounds of a public sample were accounted without
        amplification holds Poisson entries (z, q < 1, n) with the protocol's own z: they are
        restated as (z/2, 1, n), this ledger's accounting of the same rounds, so a resumed run
        reports the proven bound for every round it has run. A secret sample's entries are
        kept as they are.

        Raises:
            ValueError: the state is not this ledger's accountant's (mechanism or sampling).
        """
        self.accountant.load_state_dict(state)
        if self.accountant.sampling == "poisson":
            self.accountant.history = [
                (z / 2, 1.0, n) if q < 1 else (z, q, n) for z, q, n in self.accountant.history
            ]
        self._spent = self._next = None
