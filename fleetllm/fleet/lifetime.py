"""Child processes that must not outlive the process that started them.

``die_with_parent`` runs in the child between fork and exec (``preexec_fn``): Linux's ``PR_SET_PDEATHSIG`` sends it
SIGKILL when the thread that forked it ends, so a parent killed outright (SIGKILL, an OOM kill) leaves no orphan
holding a port. The forking thread must live as long as the child: a process's main thread, or one kept for it.
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child before exec: be killed when the forking thread of the parent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
