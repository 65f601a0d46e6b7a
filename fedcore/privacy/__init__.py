"""Privacy building blocks: accountants (dp-accounting), clipping and noise."""

from fedcore.privacy._accountant import (
    Accountant,
    PldAccountant,
    RdpAccountant,
    create_accountant,
)

__all__ = ["Accountant", "PldAccountant", "RdpAccountant", "create_accountant"]
