"""Process exit: what a stage or judge-server process does when it ends.

CPython's teardown, after the ``atexit`` handlers, runs the cyclic garbage collector over every
object still alive. A stage or judge-server process holds millions of them (the modules and
classes of torch, transformers and diffusers), so that walk alone took about 0.8 s per process on
2 CPU cores (a ``benchmark`` stage: 1.05 s from its last log line to its exit, 0.22 s with
:func:`freeze_heap_at_exit`). ``dvc repro`` waits for every stage process, and a stage for every
judge server it stops.
"""

from __future__ import annotations

import atexit
import gc

_registered = False


def freeze_heap_at_exit() -> None:
    """Spare this process the collector's walk over its whole heap at exit.

    Registers (once per process) an ``atexit`` handler that calls :func:`gc.freeze`, which moves
    every object into the permanent generation the collector skips. Objects are still released by
    reference counting; only reference cycles left at exit go uncollected, memory the process is
    about to return. Outputs are written, closed and renamed before a stage returns, so nothing a
    stage writes depends on it. In a test process it takes effect when that process exits.
    """
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True
