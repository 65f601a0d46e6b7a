"""Imported once by the local runner's forkserver so that forked roles start warm (beside
the module of the roles' entry point, ``fedcore.local.launch.RoleEntry``).

torch imports torch._dynamo lazily on an optimizer's first step (about 2 s of CPU): importing
it here, before any role is forked, saves that in every client. Nothing is computed here, so
no thread pool exists yet when the forkserver forks. The forkserver asks to be terminated when
the runner dies (and each forked role when the forkserver dies), so a runner killed with
SIGKILL leaves no role behind.
"""

import importlib

import torch

from fedcore.local.launch import die_with_parent

WARM = (
    "torch._dynamo",
    "fedcore.learning.data",
    "fedcore.learning.training",
    "fedcore.protocols",
    "fedcore.roles",
)
"""What every role imports, imported here by name so that no linter drops it as unused
(tests/unit/test_layout.py checks that a role finds them loaded)."""

for module in WARM:
    importlib.import_module(module)
torch.set_num_threads(1)
die_with_parent()
