"""mpdp (seed 000): ``protocol`` (server, client and KDC sides), ``maths`` (perturbation, noise and
fixed-point masks), ``keys`` (X25519 agreement and the pairwise keystreams).
"""

from fedcore.protocols.mpdp.protocol import Mpdp, MpdpClient, MpdpKdc, MpdpServer

__all__ = ["Mpdp", "MpdpClient", "MpdpKdc", "MpdpServer"]
