"""LPPA (seed 002): ``protocol`` (the coordinator and the peer client), ``maths`` (Laplace masks,
noise differences and the DSGT step).
"""

from fedcore.protocols.lppa.protocol import Lppa, LppaClient, LppaCoordinator

__all__ = ["Lppa", "LppaClient", "LppaCoordinator"]
