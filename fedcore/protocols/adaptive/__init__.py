"""adaptive (seed 003): ``protocol`` (server and client sides), ``maths`` (the learned distortion
and its privacy measures).
"""

from fedcore.protocols.adaptive.protocol import Adaptive, AdaptiveClient, AdaptiveServer

__all__ = ["Adaptive", "AdaptiveClient", "AdaptiveServer"]
