"""Imported once by the local runner's forkserver so that forked roles start warm.

torch imports torch._dynamo lazily on an optimizer's first step (about 2 s of CPU): importing
it here, before any role is forked, saves that in every client. Nothing is computed here, so
no thread pool exists yet when the forkserver forks.
"""

import torch
import torch._dynamo

import fedcore.cli
import fedcore.data
import fedcore.protocols
import fedcore.roles
import fedcore.training  # noqa: F401

torch.set_num_threads(1)
