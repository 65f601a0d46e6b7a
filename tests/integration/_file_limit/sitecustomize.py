"""Fault injection for tests/integration/test_local_run.py: a server role whose files may not
grow past ``FEDCORE_TEST_SERVER_FILE_BYTES`` (RLIMIT_FSIZE, as a full disk would stop them).

On ``PYTHONPATH``, Python imports this at the start of every process; it acts only in a process
started as ``... fedcore server ...`` with the variable set (Python ignores SIGXFSZ, so a write
past the limit fails with EFBIG instead of killing the process).
"""

import os
import resource

_LIMIT = os.environ.get("FEDCORE_TEST_SERVER_FILE_BYTES")
if _LIMIT:
    with open("/proc/self/cmdline", "rb") as _cmdline:
        if b"server" in _cmdline.read().split(b"\0"):
            resource.setrlimit(resource.RLIMIT_FSIZE, (int(_LIMIT), int(_LIMIT)))
