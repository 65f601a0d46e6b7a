"""lppa's maths and its client code in one process: zero-sum noise, the tracker invariant,
the average model against plain DSGT, the convex optimum, resumes, lost peers, and a
coordinator that takes no tensor."""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from fedcore.errors import PeerLost, ProtocolError
from fedcore.protocols import create_protocol
from fedcore.protocols.lppa.maths import (
    dsgt_step,
    laplace_noise,
    matrix_dsgt,
    matrix_noise_differences,
    noise_difference,
    noise_grid,
)
from fedcore.protocols.lppa.protocol import LppaClient, LppaCoordinator
from fedcore.simulation.peer import simulate_decentralized
from fedcore.spec import FederatedRun, parse_manifest, peer_graph
from fedcore.spec.topology import Graph, build_graph, mixing_matrix
from fedcore.transport import Payload

pytestmark = pytest.mark.filterwarnings("ignore:lppa draws its noise:UserWarning")

# ----------------------------------------------------------------------------- helpers


def lppa_run(
    *,
    count: int = 5,
    rounds: int = 6,
    topology: dict[str, Any] | None = None,
    hidden: list[int] | None = None,
    batch: int = 32,
    lr: float = 0.1,
    loss: str = "CrossEntropy",
    checkpoint: int = 0,
    **options: Any,
) -> FederatedRun:
    """A small float64 lppa run on digits with reproducible noise."""
    lppa = {"secureNoise": False, "topology": topology or {"kind": "Ring"}, **options}
    document = {
        "apiVersion": "fedcore.dev/v1alpha1",
        "kind": "FederatedRun",
        "metadata": {"name": "lppa-unit"},
        "spec": {
            "protocol": {"name": "lppa", "lppa": lppa},
            "model": {
                "kind": "MLP",
                "hidden": [8] if hidden is None else hidden,
                "dtype": "float64",
            },
            "clients": {"count": count},
            "rounds": rounds,
            "training": {
                "batchSize": batch,
                "loss": loss,
                "optimizer": {"kind": "SGD", "learningRate": lr},
            },
            "evaluation": {"everyRounds": 0},
            "checkpoint": {"everyRounds": checkpoint},
            "failurePolicy": {"roundTimeoutSeconds": 60},
            "seed": 4,
        },
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return parse_manifest(document)


def quiet(function: Any, *args: Any, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return function(*args, **kwargs)


def random_graph(count: int, p: float, seed: int) -> Graph:
    rng = np.random.default_rng(seed)
    edges = [[a, b] for a in range(count) for b in range(count) if a != b and rng.random() < p]
    return build_graph("Edges", count, directed=True, edges=edges)


NOISE_GRAPHS = {
    "complete": build_graph("Complete", 5),
    "ring": build_graph("Ring", 7),
    "directed ring": build_graph("Ring", 6, directed=True),
    "star": build_graph("Edges", 6, edges=[[0, k] for k in range(1, 6)]),
    "path": build_graph("Edges", 5, edges=[[0, 1], [1, 2], [2, 3], [3, 4]]),
    "random directed": random_graph(12, 0.3, seed=1),
    "disconnected": build_graph("Edges", 6, edges=[[0, 1], [1, 2], [2, 0], [3, 4]]),
    "complete 40": build_graph("Complete", 40),
}


# --------------------------------------------------------------------- the noise itself


@pytest.mark.parametrize("name", list(NOISE_GRAPHS))
@pytest.mark.parametrize("beta", [0.025, 3.0, 700.0])
def test_noise_differences_sum_to_exactly_zero_on_any_graph(name: str, beta: float) -> None:
    # Prepare: one quantised Laplace vector per directed edge.
    graph = NOISE_GRAPHS[name]
    rng = np.random.default_rng(7)
    noise = {edge: laplace_noise(rng, 50, beta) for edge in graph.edges}
    # Execute
    differences = matrix_noise_differences(graph.count, graph.edges, noise)
    # Assert: exactly zero, in two summation orders, while no single difference is zero.
    assert np.all(differences.sum(axis=0) == 0.0)
    assert np.all(differences[::-1].sum(axis=0) == 0.0)
    assert np.any(differences != 0.0)


def test_noise_is_laplace_on_a_fixed_point_grid() -> None:
    # Prepare
    beta = 0.025
    grid, bound = noise_grid(beta)
    # Execute
    noise = laplace_noise(np.random.default_rng(0), 200_000, beta)
    # Assert: on the grid, within the clip, and Laplace(beta): std sqrt(2) beta, mean |x| beta.
    assert np.all(np.round(noise / grid) * grid == noise)
    assert np.max(np.abs(noise)) <= bound
    assert np.std(noise) == pytest.approx(np.sqrt(2) * beta, rel=0.02)
    assert np.mean(np.abs(noise)) == pytest.approx(beta, rel=0.02)


def test_a_noise_difference_is_sent_minus_received() -> None:
    sent = [np.array([1.0, 2.0]), np.array([0.5, 0.5])]
    received = [np.array([4.0, 1.0])]
    assert noise_difference(sent, received).tolist() == [-2.5, 1.5]


def test_the_clients_noise_messages_cancel_exactly_and_each_is_used_by_one_pair() -> None:
    # Prepare: the real client code on a directed graph, one round, every message recorded.
    run = lppa_run(topology={"kind": "KRegular", "degree": 2, "directed": True}, rounds=1)
    # Execute
    result = simulate_decentralized(run, record=True, evaluate=False)
    # Assert
    assert result.network is not None
    noise = [
        (s, r, p.tensors["noise"])
        for s, r, tag, p in result.network.messages
        if tag.endswith("/noise")
    ]
    graph = build_graph("KRegular", 5, degree=2, directed=True)
    assert sorted((s, r) for s, r, _ in noise) == sorted(graph.edges)  # one per link
    differences = np.zeros((5, len(noise[0][2])))
    for sender, receiver, vector in noise:
        differences[sender] += vector
        differences[receiver] -= vector
    assert np.all(differences.sum(axis=0) == 0.0)
    states = [m for m in result.network.messages if m[2].endswith("/state")]
    assert len(states) == len(graph.edges)  # theta and gamma once per link per round
    assert all(set(p.tensors) == {"theta", "gamma"} for *_, p in states)


# ------------------------------------------------------------------- DSGT, pinned down


def test_dsgt_step_is_the_papers_equation_2_and_the_mixing_half_of_3() -> None:
    # Prepare: client 0 with in-neighbours 1 and 2.
    weights = {0: 0.5, 1: 0.3, 2: 0.2}
    theta, gamma = np.array([1.0, -1.0]), np.array([0.5, 2.0])
    thetas = {1: np.array([3.0, 0.0]), 2: np.array([-2.0, 4.0])}
    gammas = {1: np.array([1.0, 1.0]), 2: np.array([0.0, -5.0])}
    # Execute
    theta_next, gamma_mixed = dsgt_step(theta, gamma, 0, thetas, gammas, weights, 0.1)
    # Assert: theta' = sum_j w_ij theta_j - lambda gamma_i (own, unmixed gamma).
    np.testing.assert_allclose(theta_next, [0.5 + 0.9 - 0.4 - 0.05, -0.5 + 0 + 0.8 - 0.2])
    np.testing.assert_allclose(gamma_mixed, [0.25 + 0.3 + 0.0, 1.0 + 0.3 - 1.0])


@pytest.mark.parametrize(
    ("topology", "options"),
    [
        ({"kind": "Ring"}, {}),
        ({"kind": "Ring", "directed": True}, {}),
        ({"kind": "Complete"}, {}),
        ({"kind": "Edges", "edges": [[0, 1], [1, 2], [2, 3], [3, 4], [4, 0], [0, 2]]}, {}),
        ({"kind": "KRegular", "degree": 2, "directed": True}, {"injection": "EveryRound"}),
        ({"kind": "Ring"}, {"variant": "DSGT"}),
    ],
    ids=["ring", "directed-ring", "complete", "irregular", "every-round", "dsgt"],
)
def test_the_tracker_sum_equals_the_gradient_sum_to_1e_10_every_round(
    topology: dict[str, Any], options: dict[str, Any]
) -> None:
    # Execute: minibatches of 32, so every step's gradient is a fresh one.
    result = simulate_decentralized(
        lppa_run(topology=topology, rounds=12, **options), evaluate=False
    )
    # Assert
    residuals = [entry["tracker_residual"] for entry in result.history]
    assert len(residuals) == 12
    assert max(residuals) <= 1e-10, residuals


def test_dp_init_breaks_the_invariant_by_its_noise_sum_negative_control() -> None:
    # Execute
    result = simulate_decentralized(lppa_run(variant="DPInit", rounds=5), evaluate=False)
    residuals = [entry["tracker_residual"] for entry in result.history]
    # Assert: the DP baseline's noise does not cancel; the offset it leaves never decays.
    assert min(residuals) > 1e-3
    assert max(residuals) - min(residuals) < 1e-10


def test_dp_every_round_noise_keeps_growing_the_offset() -> None:
    result = simulate_decentralized(lppa_run(variant="DPEveryRound", rounds=8), evaluate=False)
    residuals = [entry["tracker_residual"] for entry in result.history]
    assert residuals[-1] > residuals[0] > 1e-3


def test_the_average_model_after_round_1_equals_plain_dsgts_but_each_client_differs() -> None:
    # Execute
    lppa = simulate_decentralized(lppa_run(rounds=1), evaluate=False)
    dsgt = simulate_decentralized(lppa_run(rounds=1, variant="DSGT"), evaluate=False)
    # Assert
    for name in dsgt.mean:
        np.testing.assert_allclose(lppa.mean[name], dsgt.mean[name], rtol=0, atol=1e-12)
    differs = max(
        float(np.max(np.abs(lppa.clients[k][n] - dsgt.clients[k][n])))
        for k in dsgt.clients
        for n in dsgt.clients[k]
    )
    assert differs > 1e-4, "LPPA's noise must move each client's own model"


def logistic_problem(count: int = 5, size: int = 6, seed: int = 0) -> Any:
    """L2-regularised logistic regression split over clients (strongly convex)."""
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(40, size)) for _ in range(count)]
    w_true = rng.normal(size=size)
    ys = [(x @ w_true + rng.normal(scale=0.5, size=40) > 0).astype(float) for x in xs]

    def gradient(i: int, theta: np.ndarray, t: int) -> np.ndarray:
        p = 1 / (1 + np.exp(-(xs[i] @ theta)))
        return xs[i].T @ (p - ys[i]) / len(ys[i]) + 0.1 * theta

    return gradient


@pytest.mark.parametrize("topology", ["Complete", "Ring"])
def test_lppa_reaches_dsgts_optimum_on_a_strongly_convex_problem(topology: str) -> None:
    # Prepare
    count, size, beta = 5, 6, 0.025
    graph = build_graph(topology, count)  # type: ignore[arg-type]
    mixing = mixing_matrix(graph).dense()
    gradient = logistic_problem(count, size)
    rng = np.random.default_rng(3)
    noise = {edge: laplace_noise(rng, size, beta) for edge in graph.edges}
    lppa_noise = matrix_noise_differences(count, graph.edges, noise)
    dp_noise = np.stack([laplace_noise(rng, size, beta) for _ in range(count)])
    theta0 = np.zeros((count, size))
    # Execute
    runs = {
        name: matrix_dsgt(mixing, theta0, gradient, rounds=2000, step_size=0.05, init_noise=init)[
            -1
        ]["theta"]
        for name, init in (("dsgt", None), ("lppa", lppa_noise), ("dp", dp_noise))
    }
    # Assert: the same optimum (to 1e-6); DP-init converges to a shifted one.
    assert np.max(np.abs(runs["lppa"] - runs["dsgt"])) <= 1e-6
    assert np.max(np.abs(runs["dp"] - runs["dsgt"])) > 1e-3
    assert np.max(np.abs(runs["dsgt"] - runs["dsgt"].mean(axis=0))) <= 1e-6  # consensus


def test_the_client_code_forgets_the_noise_on_a_convex_model() -> None:
    # Prepare: a linear model with MSE loss and full batches (convex; no randomness but
    # LPPA's), on a directed graph.
    topology = {"kind": "KRegular", "degree": 2, "directed": True}

    def gap(rounds: int) -> tuple[float, Any]:
        common = {
            "hidden": [],
            "batch": 100_000,
            "loss": "MSE",
            "lr": 0.1,
            "topology": topology,
            "rounds": rounds,
        }
        lppa = simulate_decentralized(lppa_run(**common), evaluate=False)
        dsgt = simulate_decentralized(lppa_run(variant="DSGT", **common), evaluate=False)
        worst = max(
            float(np.max(np.abs(lppa.clients[k][n] - dsgt.clients[k][n])))
            for k in dsgt.clients
            for n in dsgt.clients[k]
        )
        return worst, lppa

    # Execute
    first, _ = gap(1)
    last, lppa = gap(100)
    # Assert: each client starts off DSGT's path by the noise, and ends on it.
    assert first > 1e-3
    assert last < first * 1e-3
    assert max(entry["tracker_residual"] for entry in lppa.history) <= 1e-10


# ---------------------------------------------- what a curious neighbour reads (leaks)


Tensors = dict[int, dict[int, np.ndarray]]


def seen_by_neighbours(run: FederatedRun) -> tuple[Tensors, Tensors]:
    """Every tracker sent, as ``trackers[t][sender]`` (gamma^t, from the recorded peer
    messages), and every client's true gradient after round r, as ``grads[r][client]``."""
    grads: Tensors = {}

    def keep(round_: int, clients: dict[int, Any]) -> None:
        grads[round_] = {k: c.vectors()["grad"].copy() for k, c in clients.items()}

    result = simulate_decentralized(run, after_round=keep, evaluate=False, record=True)
    trackers: Tensors = {}
    assert result.network is not None
    for sender, _, tag, payload in result.network.messages:
        _, round_, kind = tag.rsplit("/", 2)
        if kind == "state":  # round r carries (theta^t, gamma^t), t = r - 1
            trackers.setdefault(int(round_) - 1, {})[sender] = payload.tensors["gamma"]
    return trackers, grads


@pytest.mark.parametrize("injection", ["Init", "EveryRound"])
def test_on_a_complete_graph_a_neighbour_reads_exact_gradient_differences(injection: str) -> None:
    # Prepare: complete graph, so client 1 receives every other client's tracker (leak 2).
    run = lppa_run(topology={"kind": "Complete"}, rounds=5, injection=injection)
    weights = peer_graph(run.spec)[1].dense()
    victim, count = 0, run.spec.clients.count
    # Execute: gamma_0^{t+1} - sum_j w_0j gamma_j^t, from the trackers client 1 receives.
    trackers, grads = seen_by_neighbours(run)
    errors, sizes = [], []
    for t in range(1, 4):
        mixed = sum(weights[victim, j] * trackers[t][j] for j in range(count))
        recovered = trackers[t + 1][victim] - mixed
        truth = grads[t + 1][victim] - grads[t][victim]  # g^{t+1} - g^t
        errors.append(float(np.max(np.abs(recovered - truth))))
        sizes.append(float(np.max(np.abs(truth))))
    # Assert: exact with the paper's init-only noise; masked by fresh noise with EveryRound.
    assert min(sizes) > 1e-4, "the gradient differences must not be trivially zero"
    if injection == "Init":
        assert max(errors) <= 1e-12, errors
    else:
        assert min(errors) > 1e-3, errors


def test_on_a_complete_graph_the_first_trackers_add_up_to_the_exact_gradient_sum() -> None:
    # Prepare: leak 3. DSGT's first trackers are the first gradients, the same as LPPA's.
    lppa, _ = seen_by_neighbours(lppa_run(topology={"kind": "Complete"}, rounds=1))
    plain, _ = seen_by_neighbours(lppa_run(topology={"kind": "Complete"}, rounds=1, variant="DSGT"))
    # Execute
    total = sum(lppa[0].values())
    masked = min(float(np.max(np.abs(lppa[0][k] - plain[0][k]))) for k in plain[0])
    # Assert: whoever receives every first tracker has the gradients' exact sum, although
    # every single tracker is masked.
    np.testing.assert_allclose(total, sum(plain[0].values()), rtol=0, atol=1e-12)
    assert masked > 1e-3


# ------------------------------------------------------------ resumes and lost peers


def test_clients_resumed_from_their_states_end_bit_for_bit_as_the_uninterrupted_run() -> None:
    # Prepare: every client's state after round 3, as its checkpoint would hold it.
    run = lppa_run(rounds=6, injection="EveryRound")
    states: dict[int, dict[str, Any]] = {}

    def keep(round_: int, clients: dict[int, Any]) -> None:
        if round_ == 3:
            states.update({k: copy.deepcopy(c.state_dict()) for k, c in clients.items()})

    whole = simulate_decentralized(run, after_round=keep, evaluate=False)
    # Execute
    resumed = simulate_decentralized(run, resume=(3, states), evaluate=False)
    # Assert
    for k, weights in whole.clients.items():
        for name, value in weights.items():
            assert np.array_equal(resumed.clients[k][name], value), (k, name)


def test_a_peer_lost_after_the_noise_exchange_fails_its_neighbours_naming_it() -> None:
    # Prepare
    run = lppa_run(rounds=4)

    def lose(round_: int, clients: dict[int, Any]) -> None:
        if round_ == 2:
            network = clients[0]._peers._network  # the simulation's in-memory network
            network.fail(3, "killed")

    # Execute / Assert: client 3's neighbours (2 and 4 on the ring) stop in round 3.
    with pytest.raises(PeerLost, match="client 3 was lost \\(killed\\)"):
        simulate_decentralized(run, after_round=lose, evaluate=False)


def test_a_client_refuses_a_round_its_state_does_not_start_from() -> None:
    # Prepare
    run = lppa_run()
    client = quiet(LppaClient, run.spec, 0)
    client.setup_peers(SimpleNamespace(index=0))  # type: ignore[arg-type]
    instruction = Payload(meta={"epoch": "e", "base_round": 4})
    # Execute / Assert
    with pytest.raises(ProtocolError, match="must restore its checkpoint first"):
        client.compute_upload(5, instruction, None, None)  # type: ignore[arg-type]


# ------------------------------------------------------------------- the coordinator


def test_the_coordinator_plans_no_tensors_and_refuses_any_tensor_or_unknown_key() -> None:
    # Prepare
    run = lppa_run(checkpoint=2)
    coordinator = create_protocol("lppa").create_server(run.spec, {"w": np.zeros(3)})
    # Execute
    plans = coordinator.plan_round(2, [0, 1, 2, 3, 4])
    # Assert
    assert all(not plan.tensors for plan in plans.values())
    assert plans[0].meta["checkpoint"] is True and plans[0].meta["base_round"] == 1
    assert coordinator.global_weights() == {}
    with pytest.raises(ProtocolError, match="accepts no tensors"):
        coordinator.check_upload(1, 0, Payload(meta={"loss": 1.0}, tensors={"theta": np.zeros(3)}))
    with pytest.raises(ProtocolError, match="accepts only"):
        coordinator.check_upload(1, 0, Payload(meta={"loss": 1.0, "gamma_norm": 2.0}))
    with pytest.raises(ProtocolError, match="a finite number"):
        coordinator.check_upload(1, 0, Payload(meta={"loss": float("nan")}))


def test_the_coordinator_combines_scalars_and_requires_every_checkpoint() -> None:
    # Prepare
    coordinator = LppaCoordinator(lppa_run(checkpoint=2, count=3).spec)

    def upload(accuracy: float, checkpointed: int | None) -> Payload:
        meta: dict[str, Any] = {
            "loss": 1.0,
            "num_examples": 10,
            "eval_accuracy": accuracy,
            "eval_loss": 0.5,
            "disagreement": accuracy,
            "peer_bytes_sent": 100,
        }
        if checkpointed is not None:
            meta["checkpointed"] = checkpointed
        return Payload(meta=meta)

    # Execute
    result = coordinator.combine(2, {0: upload(0.5, 2), 1: upload(0.7, 2), 2: upload(0.9, 2)}, [])
    # Assert
    assert result is not None
    assert result.metrics["accuracy"] == pytest.approx(0.7)
    assert result.metrics["accuracy_min"] == 0.5 and result.metrics["accuracy_max"] == 0.9
    assert result.metrics["peer_bytes_sent"] == 300
    with pytest.raises(ProtocolError, match="not every client wrote its checkpoint"):
        coordinator.combine(2, {0: upload(0.5, 2), 1: upload(0.7, None)}, [])
    with pytest.raises(ProtocolError, match="cannot go on without them"):
        coordinator.combine(3, {0: upload(0.5, None)}, [1])
