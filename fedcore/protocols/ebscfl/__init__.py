"""EBS-CFL (seed 004): ``protocol`` (server, client and KDC sides), ``maths`` (encodings,
verification, decoding), ``keys`` (the KDC's key derivation and lifetimes).
"""

from fedcore.protocols.ebscfl.protocol import Ebscfl, EbscflClient, EbscflKdc, EbscflServer

__all__ = ["Ebscfl", "EbscflClient", "EbscflKdc", "EbscflServer"]
