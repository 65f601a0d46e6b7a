"""LPPA's neighbour attack (digest 002 §1, leak 1) and how the audit reads peer messages.

In a decentralized run there is no server model: every client sends its model theta_i and
tracker gamma_i to its out-neighbours each round, and in round 1 first sends each of them a
Laplace noise vector. The victim's first tracker is gamma_i^0 = g_i^0 + (noise sent - noise
received), g_i^0 its gradient at the common initial model. An out-neighbour knows the noise it
exchanged with the victim (the vector the victim sent it, and the one it sent the victim), so
it removes those terms; what is left is the gradient plus the noise terms that do not involve
it (one Laplace vector on a directed ring, none for plain DSGT). It then inverts that
gradient: for a one-example batch analytically (the first layer's weight gradient is
delta x^T, so its top right singular vector is the input's direction, the noise averaged over
the rows: digest 002 B3's x = g_w / g_b; scaled to the prior's norm), otherwise with DLG at
the victim's theta^0, as the paper's own attacker does on the raw gamma.
"""

from __future__ import annotations

from pathlib import Path
from types import MappingProxyType

import numpy as np

from fedcore.audit import _figures
from fedcore.audit._attack import Attack, AttackResult, AuditContext, peer_tensor
from fedcore.audit._metrics import Estimate
from fedcore.audit._reconstruct import Bounds, Scores, invert, scale_direction
from fedcore.audit._views import BroadcastModel, PlainView, ProtocolView, UpdateKind
from fedcore.learning.models import build_model, get_weights
from fedcore.protocols._batches import batch_rows
from fedcore.protocols.lppa.maths import unflatten
from fedcore.spec import FederatedRunSpec
from fedcore.transport import Payload

STATE, NOISE = "state", "noise"
"""The kinds of LPPA's peer messages (model and tracker; round 1's link noise)."""


def senders(instruction: Payload, kind: str = STATE) -> list[int]:
    """The in-neighbours whose ``kind`` message ``instruction`` (a client's round) holds."""
    found = set()
    for name in instruction.tensors:
        peer, got, _ = name.split("/", 2)
        if got == kind:
            found.add(int(peer))
    return sorted(found)


class LppaView(ProtocolView):
    """lppa: a client's round is the (theta, gamma) of each in-neighbour; the coordinator
    sees no tensor. ``broadcast`` reads the lowest-index in-neighbour's model."""

    skips = MappingProxyType(
        {
            "dlg": "the lppa coordinator receives no tensor: models and trackers go only to "
            "neighbours (see lppa-neighbour)",
            "inverting-gradients": "the lppa coordinator receives no tensor: models and "
            "trackers go only to neighbours (see lppa-neighbour)",
            "differencing-inversion": "a neighbour's model moves by mixing its neighbours' "
            "models and its tracker, not by a released aggregate the client took part in",
            "differencing-subspace": "a neighbour's model moves by mixing its neighbours' "
            "models and its tracker, not by one step of inputs",
        }
    )

    def __init__(self, spec: FederatedRunSpec) -> None:
        super().__init__(spec)
        self._plain = PlainView(spec)
        module = build_model(spec.model, self.input_shape, self.num_classes, seed=spec.seed)
        self._template = get_weights(module)

    def model_of(self, vector: np.ndarray) -> Payload:
        """A flat theta as the model's named tensors."""
        return Payload(tensors=unflatten(np.asarray(vector), self._template))

    def gradient_of(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        """A flat gradient (or tracker) as float64 tensors by the model's names."""
        named = unflatten(np.asarray(vector, np.float64), self._template)
        return {n: np.asarray(v, np.float64) for n, v in named.items()}

    def _neighbour(self, instruction: Payload) -> Payload:
        first = senders(instruction)[0]
        return self.model_of(instruction.tensors[peer_tensor(first, STATE, "theta")])

    def broadcast(self, instruction: Payload) -> BroadcastModel:
        return self._plain.broadcast(self._neighbour(instruction))

    def server_gradient(
        self, instruction: Payload, upload: Payload
    ) -> tuple[dict[str, np.ndarray], UpdateKind] | None:
        return None

    def first_layer(self, instruction: Payload) -> np.ndarray | None:
        return self._plain.first_layer(self._neighbour(instruction))


def rank_one(weight: np.ndarray) -> np.ndarray:
    """The input's direction behind a one-example first-layer weight gradient delta x^T (plus
    noise): its top right singular vector (digest 002 B3's x = g_w / g_b, all rows at once)."""
    _, _, vt = np.linalg.svd(np.asarray(weight, np.float64), full_matrices=False)
    return np.asarray(vt[0])


def unknown_noise_rms(ctx: AuditContext, victim: int) -> float:
    """The root mean square of the noise in the victim's first tracker that the attacker does
    not know (the terms of links not involving it), from every recorded round-1 message."""
    total: np.ndarray | None = None
    for sender, receiver, kind, message in ctx.recording.peers.get(1, []):
        if kind != NOISE or ctx.attacker in (sender, receiver) or victim not in (sender, receiver):
            continue
        noise = np.asarray(message.tensors["noise"], np.float64)
        term = noise if sender == victim else -noise
        total = term if total is None else total + term
    return 0.0 if total is None else float(np.sqrt(np.mean(total**2)))


class NeighbourAttack(Attack):
    """Digest 002 §1 (1): an out-neighbour removes the noise it knows and inverts gamma^0."""

    name = "lppa-neighbour"
    title = "LPPA neighbour attack on the first tracker"
    view = "client"
    protocols = frozenset({"lppa"})
    assumes = (
        "The curious client, an out-neighbour of each victim, takes the victim's first "
        "tracker gamma^0 and model theta^0 (round 1), removes the two noise terms it knows "
        "(the vector the victim sent it, and the one it sent the victim) and inverts what is "
        "left, the victim's first minibatch gradient plus the noise terms not involving it: "
        "for a one-example batch by the top right singular vector of the first layer's weight "
        "gradient (delta x^T; digest 002 B3's x = g_w / g_b over all rows), scaled to its "
        "prior's norm; for more examples by DLG at theta^0 (the best of the restarts for up to "
        "8). 'As received' is the same on the raw gamma^0, the paper's attacker. Knows the "
        "architecture, the loss, the batch size and the data range; its blind guess is the "
        "mean of its own shard."
    )

    def skip_reason(self, ctx: AuditContext) -> str | None:
        if ctx.spec.protocol.name == "lppa" and not isinstance(ctx.view, LppaView):
            return "the audit has no peer view of this run"
        return super().skip_reason(ctx)

    def run(self, ctx: AuditContext) -> AttackResult:
        rec = ctx.recording
        view = ctx.view
        assert isinstance(view, LppaView)
        bounds = Bounds.of(ctx.shard(ctx.attacker).x)
        received = rec.instructions.get(1, {}).get(ctx.attacker)
        if received is None:
            return self.result(skipped="round 1 (the first trackers) was not recorded")
        sent = rec.uploads.get(1, {}).get(ctx.attacker, Payload())
        denoised, raw = Scores.empty(), Scores.empty()
        attacked: list[dict[str, object]] = []
        rng = ctx.rng(61)
        spec = ctx.spec
        for victim in senders(received)[: ctx.budget.victims]:
            gamma = np.asarray(received.tensors[peer_tensor(victim, STATE, "gamma")], np.float64)
            theta = received.tensors[peer_tensor(victim, STATE, "theta")]
            known = np.zeros_like(gamma)
            from_victim = received.tensors.get(peer_tensor(victim, NOISE, "noise"))
            to_victim = sent.tensors.get(peer_tensor(victim, NOISE, "noise"))
            if from_victim is not None:
                known += from_victim  # the victim sent it: + in its tracker
            if to_victim is not None:
                known -= to_victim  # the victim received it: - in its tracker
            shard = ctx.shard(victim)
            rows = batch_rows(
                len(shard), spec.training.batch_size, seed=spec.seed, step=0, client=victim
            )
            targets = shard if rows is None else shard.subset(rows)
            if len(targets) > ctx.budget.max_batch:
                continue
            model = view.broadcast(Payload(tensors={peer_tensor(victim, STATE, "theta"): theta}))
            for scores, seen in ((denoised, gamma - known), (raw, gamma)):
                gradient = view.gradient_of(seen)
                layer = next(
                    (
                        n
                        for n, v in gradient.items()
                        if v.ndim == 2 and v.shape[1] == view.input_size
                    ),
                    None,
                )
                if len(targets) == 1 and layer is not None:
                    recon = scale_direction(rank_one(gradient[layer]), bounds)[None, :]
                else:
                    recon = invert(
                        model,
                        gradient,
                        batch=len(targets),
                        num_classes=view.num_classes,
                        bounds=bounds,
                        method="dlg",
                        iterations=ctx.budget.dlg_iterations,
                        rng=rng,
                        restarts=ctx.budget.restarts if len(targets) <= 8 else 1,
                    )
                scores.add(recon, targets.x, bounds)
            attacked.append(
                {
                    "victim": victim,
                    "examples": len(targets),
                    "known_noise": [from_victim is not None, to_victim is not None],
                    "unknown_noise_rms": unknown_noise_rms(ctx, victim),
                }
            )
        if not denoised.psnr:
            return self.result(skipped=f"no victim's batch holds at most {ctx.budget.max_batch}")
        estimates = denoised.estimates(ctx.rng(62))
        as_received = raw.estimates(ctx.rng(63))
        shown: list[Estimate] = [
            *estimates,
            *(
                Estimate(
                    f"{e.name}, as received",
                    e.value,
                    e.low,
                    e.high,
                    e.n,
                    e.interval,
                    e.chance,
                    e.attacker_higher,
                )
                for e in as_received[:2]
            ),
        ]
        figure = f"{self.name}.png"
        _figures.reconstructions(
            ctx.figures / figure,
            denoised.pairs,
            bounds.shape,
            f"{self.title}: {spec.protocol.lppa.variant}",
            low=bounds.low,
            high=bounds.high,
        )
        return self.result(
            verdict=shown[0],
            estimates=shown,
            details={"round": 1, "victims": attacked, "variant": spec.protocol.lppa.variant},
            figures=[str(Path(ctx.figures.name) / figure)],
        )
