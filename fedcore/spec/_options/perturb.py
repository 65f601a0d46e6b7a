"""Options of ``perturb``: accuracy-lossless model perturbation (seed 001)."""

from __future__ import annotations

from pydantic import Field

from fedcore.spec._base import SpecModel


class PerturbOptions(SpecModel):
    """Options of the ``perturb`` protocol (digest 001)."""

    residual_bound: float = Field(
        1e-8,
        gt=0,
        le=1,
        description="residualBound is the largest recovery residual the server accepts in a "
        "round. For each client's recovered gradient G the server checks, for every hidden "
        "neuron, that <incoming weights, their gradient> equals <outgoing weights, their "
        "gradient> (true for any gradient of a bias-free ReLU network); the residual is the "
        "worst difference relative to max over layers of <|W|, |G|>. It is a proxy: measured "
        "on digits, the largest relative error of the gradient was 25 to 80 times the residual. "
        "Past the bound the server stops the run with a RecoveryError naming the round, the "
        "client and the residual. Default 1e-8.",
    )
    cells: int | None = Field(
        None,
        ge=1,
        le=1_000_000,
        description="cells is m, the number of cells of the public partition of the outputs; "
        "each cell gets one secret output noise scale, and each client uploads m+2 tensors per "
        "weight matrix. The paper's Theorem 5 bounds by 1/m a client's chance of reading the "
        "top class off a perturbed output; a client that fits the noise with its own labels "
        "reads it anyway (docs/protocols/perturb.md). Unset (default): one cell per output "
        "class. At most the number of classes (checked when the server starts).",
    )

    hidden_scale: float = Field(
        10.0,
        gt=1,
        le=100,
        description="hiddenScale h: each hidden neuron's secret scale r is drawn log-uniformly "
        "from [1/h, h], fresh every round, always strictly positive. A wider range costs recovery "
        "precision (docs/protocols/perturb.md). Default 10.",
    )
    output_scale: float = Field(
        2.0,
        gt=1,
        le=100,
        description="outputScale b: the magnitudes of the secret cell scales gamma and of the "
        "public output noise r^(a) are drawn log-uniformly from [1/b, b], with random signs, "
        "fresh every round; the output noise is pairwise distinct. A wider range costs "
        "recovery precision faster than hiddenScale does. Default 2.",
    )
    secure_secrets: bool = Field(
        True,
        description="secureSecrets draws each round's secrets from the operating system's "
        "CSPRNG (true, default; a run is then equal to fedsgd to rounding, not bit-identical to "
        "another run) or from a generator seeded by spec.seed (false: reproducible, for tests "
        "only, and warned about: every client knows the seed, so it can undo the perturbation).",
    )
