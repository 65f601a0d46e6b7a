"""perturb (seed 001): ``protocol`` (server and client sides), ``maths`` (the secret perturbation
and the exact gradient's recovery).
"""

from fedcore.protocols.perturb.protocol import Perturb, PerturbClient, PerturbServer

__all__ = ["Perturb", "PerturbClient", "PerturbServer"]
