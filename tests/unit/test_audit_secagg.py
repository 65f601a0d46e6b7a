"""The audit reads secagg from the server's seat as the server receives it, the stage-2 masked
input, and the server's inversion of it fails where the same inversion of fedavg's plaintext
upload succeeds (small simulated runs, seconds each, all randomness seeded)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fedcore.audit import AuditReport, Budget, Recording, run_audit, view_for
from fedcore.audit._views import SecAggView
from fedcore.learning.data import dataset_info
from fedcore.learning.models import build_model, get_weights
from fedcore.protocols.secagg import maths as sm
from fedcore.protocols.secagg.protocol import MASKED, MASKED_STAGE, float_names
from fedcore.simulation import simulate
from fedcore.spec import FederatedRun
from fedcore.transport import Payload
from tests.unit.test_audit import _one_thread as _one_thread  # autouse: one torch thread
from tests.unit.test_audit import one_example_clients

CLEARLY_BETTER_DB = 10.0
"""A reconstruction clearly better than the blind guess: a mean PSNR gain over it of 10 dB or
more, i.e. a tenth of the blind guess's squared error or less."""

ATTACKS = ["dlg", "inverting-gradients", "differencing-inversion"]


def small_run(folder: Path, protocol: str) -> FederatedRun:
    """4 clients holding one digit each, MLP 64-32-10, 2 rounds of one SGD step each."""
    return one_example_clients(
        folder,
        4,
        {"name": protocol},
        model={"kind": "MLP", "hidden": [32]},
        rounds=2,
        loss="CrossEntropy",
    )


def test_recording_keeps_every_later_stage_of_the_kept_rounds(tmp_path: Path) -> None:
    # Prepare
    run = small_run(tmp_path, "secagg")
    recording = Recording({2})
    # Execute
    simulate(run, observer=recording)
    # Assert: round 2 only; stages 1 to 5 of each of the 4 clients; stage 3 is the masked input,
    # one uint64 word per float parameter; the stage-0 upload carries no tensor.
    assert sorted(recording.stages) == [2]
    assert sorted(recording.stages[2]) == [(s, k) for s in range(1, 6) for k in range(4)]
    size = sum(w.size for w in recording.before[2].values())
    for k in range(4):
        _, masked = recording.stages[2][(MASKED_STAGE, k)]
        assert masked.tensors[MASKED].dtype == np.uint64 and masked.tensors[MASKED].size == size
        assert not recording.uploads[2][k].tensors


def test_secagg_view_reads_levels_as_the_update_and_masked_words_as_noise(tmp_path: Path) -> None:
    # Prepare: an update quantized as a client quantizes it, once as its levels (what a server
    # would read without masks) and once under a uniform mask mod 2^bits.
    spec = small_run(tmp_path, "secagg").spec
    view = view_for(spec)
    assert isinstance(view, SecAggView)
    rng = np.random.default_rng(0)
    shape, classes = dataset_info(spec)
    weights = get_weights(build_model(spec.model, shape, classes, seed=0))
    names = float_names(weights)
    update = {n: rng.normal(0, 0.01, weights[n].shape) for n in names}
    options = spec.protocol.secagg_options()
    levels = 2**options.quantization_bits
    q = sm.Quantization(options.clip_range, levels, sm.choose_bits(4, levels))
    flat = np.concatenate([update[n].reshape(-1) for n in names])
    words = sm.quantize(flat, q, stochastic=False)
    mask = rng.integers(0, 2**q.bits, size=flat.size, dtype=np.uint64)
    step = 2 * q.clip / (levels - 1)
    instruction = Payload(tensors=weights)
    # Execute
    plain = view.server_gradient(instruction, Payload(tensors={MASKED: words}))
    masked = view.server_gradient(
        instruction, Payload(tensors={MASKED: (words + mask) % 2**q.bits})
    )
    # Assert: the levels read back as the update (the broadcast minus the trained model, as
    # fedavg's), to within a quantization step; the masked words land far outside [-c, c].
    assert plain is not None and masked is not None and plain[1] == "update"
    for n in names:
        np.testing.assert_allclose(plain[0][n], -update[n], atol=step)
    readings = np.concatenate([masked[0][n].reshape(-1) for n in names])
    assert np.abs(readings).max() > 4 * q.clip
    assert view.server_gradient(instruction, Payload()) is None


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, AuditReport]:
    """The server's inversions on the same small run under secagg and under fedavg."""
    out = {}
    for protocol in ("secagg", "fedavg"):
        folder = tmp_path_factory.mktemp(protocol)
        out[protocol] = run_audit(
            small_run(folder / "data", protocol),
            folder / "out",
            attacks=ATTACKS,
            budget=Budget(victims=2),
        )
    return out


def test_server_inversion_of_secagg_masked_inputs_is_no_better_than_blind_guessing(
    reports: dict[str, AuditReport],
) -> None:
    # Execute: inverting gradients on the first two masked inputs of rounds 1 and 2, read as
    # if they were the clients' quantized updates.
    result = reports["secagg"].result("inverting-gradients")
    # Assert: it ran on 4 masked inputs of one example each, and its mean PSNR gain over the
    # blind guess (the report's verdict) does not exceed 0 dB at the interval's lower end.
    assert result.skipped is None and result.verdict is not None
    assert [u["round"] for u in result.details["uploads"]] == [1, 1, 2, 2]
    assert result.verdict.name == "PSNR gain over the prior (dB)"
    assert result.verdict.chance == 0.0 and not result.verdict.beats_chance


def test_the_same_inversion_of_fedavg_uploads_is_clearly_better_than_blind_guessing(
    reports: dict[str, AuditReport],
) -> None:
    # Execute: the control, the same run under fedavg (each upload the trained model).
    result = reports["fedavg"].result("inverting-gradients")
    # Assert: the verdict beats the blind guess, and by at least 10 dB.
    assert result.verdict is not None and result.verdict.beats_chance
    assert result.verdict.low >= CLEARLY_BETTER_DB


def test_secagg_audit_skips_what_its_messages_cannot_give(
    reports: dict[str, AuditReport],
) -> None:
    # Assert: DLG needs a gradient (as on fedavg, whose uploads are trained models too), and
    # differencing needs the attacker's own update, which no secagg message carries in clear.
    report = reports["secagg"]
    assert "not gradients" in (report.result("dlg").skipped or "")
    assert "own update" in (report.result("differencing-inversion").skipped or "")
    assert reports["fedavg"].result("differencing-inversion").skipped is None
