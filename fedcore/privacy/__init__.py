"""Privacy building blocks: accountants (dp-accounting), the per-run ledger, clipping, noise."""

from fedcore.privacy._accountant import (
    Accountant,
    PldAccountant,
    RdpAccountant,
    create_accountant,
)
from fedcore.privacy._ledger import PrivacyLedger
from fedcore.privacy._noise import (
    NOISE_STREAM,
    clip_by_global_norm,
    gaussian_noise_like,
    global_norm,
    noise_generator,
)

__all__ = [
    "NOISE_STREAM",
    "Accountant",
    "PldAccountant",
    "PrivacyLedger",
    "RdpAccountant",
    "clip_by_global_norm",
    "create_accountant",
    "gaussian_noise_like",
    "global_norm",
    "noise_generator",
]
