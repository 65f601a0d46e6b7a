"""Imported once by the local runner's forkserver so that forked roles start warm (beside
the module of the roles' entry point, ``fedcore.local.launch.RoleEntry``).

torch imports torch._dynamo lazily on an optimizer's first step (about 2 s of CPU): importing
it here, before any role is forked, saves that in every client. Nothing is computed here, so
no thread pool exists yet when the forkserver forks. The forkserver asks to be terminated when
the runner dies (and each forked role when the forkserver dies), so a runner killed with
SIGKILL leaves no role behind.

Python's cyclic garbage collector is off while these import (torch's import allocates objects
by the hundred thousand, and the collections it triggers cost a third of the import time here);
then ``gc.freeze()`` moves everything imported into the permanent generation, so that no
forked role's collection walks (and, by touching, copies) the forkserver's pages.
"""

import gc
import importlib

WARM = (
    "torch",
    "torch._dynamo",
    "fedcore.learning.data",
    "fedcore.learning.training",
    "fedcore.protocols",
    "fedcore.roles",
)
"""What every role imports, imported here by name so that no linter drops it as unused
(tests/unit/test_layout.py checks that a role finds them loaded)."""

gc.disable()
for module in WARM:
    importlib.import_module(module)
threads = importlib.import_module("fedcore.local.threads")
threads.limit_threads(threads.ROLE_THREADS)  # what every role runs at unless told otherwise
importlib.import_module("fedcore.local.launch").die_with_parent()
gc.freeze()
gc.enable()
