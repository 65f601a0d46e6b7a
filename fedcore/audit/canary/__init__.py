"""The canary privacy audit: a measured epsilon beside the claimed one (docs/audit.md).

``run_canary_audit`` simulates a run with canary clients (``fedcore.learning.canary``) and
reads the final model; ``estimate`` holds the statistics, ``report`` the report's section.
"""

from fedcore.audit.canary.estimate import (
    OneRunBound,
    OneShotEstimate,
    gaussian_hockey_stick,
    gaussian_pair_epsilon,
    one_run_epsilon,
    one_run_lower_bound,
    one_run_p_value,
    one_shot_estimate,
)
from fedcore.audit.canary.run import CanaryAudit, check_canaries, run_canary_audit

__all__ = [
    "CanaryAudit",
    "OneRunBound",
    "OneShotEstimate",
    "check_canaries",
    "gaussian_hockey_stick",
    "gaussian_pair_epsilon",
    "one_run_epsilon",
    "one_run_lower_bound",
    "one_run_p_value",
    "one_shot_estimate",
    "run_canary_audit",
]
