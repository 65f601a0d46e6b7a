"""Imported once by the local runner's forkserver so that forked roles start warm (beside
the module of the roles' entry point, ``fedcore.local.launch.RoleEntry``).

torch imports torch._dynamo lazily on an optimizer's first step (about 2 s of CPU): importing
it here, before any role is forked, saves that in every client. Nothing is computed here, so
no thread pool exists yet when the forkserver forks. The forkserver asks to be terminated when
the runner dies (and each forked role when the forkserver dies), so a runner killed with
SIGKILL leaves no role behind.
"""

import torch
import torch._dynamo

from fedcore.local.launch import die_with_parent

torch.set_num_threads(1)
die_with_parent()
