"""Role processes: the server, client and KDC mains. They move bytes, keep time and handle
dropouts; they know nothing of any protocol's maths."""

from fedcore.roles._common import RoleConfig
from fedcore.roles.client import Client, run_client
from fedcore.roles.kdc import Kdc, run_kdc
from fedcore.roles.server import Server, run_server

__all__ = ["Client", "Kdc", "RoleConfig", "Server", "run_client", "run_kdc", "run_server"]
