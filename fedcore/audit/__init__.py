"""The privacy audit: run a FederatedRun with an attacker attached and measure what leaks.

``run_audit`` simulates the run in one process (``fedcore.simulation``) with a ``Recording``
observer in one party's seat, runs the registered attacks on what that party saw, and writes
a Markdown report with PNG figures. See docs/audit.md for what each attack assumes.
"""

from fedcore.audit._attack import (
    Attack,
    AttackResult,
    AuditContext,
    Budget,
    Recording,
    register_attack,
    registered_attacks,
)
from fedcore.audit._client_side import MembershipLoss, MembershipShadow, OutputNoise
from fedcore.audit._ebscfl import (
    DecodeKeyLeak,
    DifferencingLeak,
    EbscflView,
    SegmentSolveLeak,
    SpectralLeak,
)
from fedcore.audit._inversion import (
    CorrectionLeak,
    DifferencingInversion,
    DifferencingSubspace,
    GradientInversion,
)
from fedcore.audit._lppa import LppaView, NeighbourAttack
from fedcore.audit._metrics import Estimate
from fedcore.audit._runner import AuditReport, run_audit
from fedcore.audit._views import ProtocolView, register_view, view_for

register_attack(GradientInversion("dlg"))
register_attack(GradientInversion("inverting-gradients"))
register_attack(DifferencingInversion())
register_attack(DifferencingSubspace())
register_attack(CorrectionLeak())
register_attack(OutputNoise())
register_attack(MembershipLoss())
register_attack(MembershipShadow())
register_attack(DecodeKeyLeak())
register_attack(SpectralLeak())
register_attack(DifferencingLeak())
register_attack(SegmentSolveLeak())
register_attack(NeighbourAttack())
register_view("ebscfl", EbscflView)
register_view("lppa", LppaView)

__all__ = [
    "Attack",
    "AttackResult",
    "AuditContext",
    "AuditReport",
    "Budget",
    "Estimate",
    "ProtocolView",
    "Recording",
    "register_attack",
    "register_view",
    "registered_attacks",
    "run_audit",
    "view_for",
]
