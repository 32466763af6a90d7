"""Process exit: what a stage or judge-server process does when it ends.

CPython's teardown, after the ``atexit`` handlers, runs the cyclic garbage collector over every
object still alive. A stage or judge-server process holds millions of them (the modules and
classes of torch, transformers and diffusers), so that walk alone takes most of the time from a
stage's last log line to its exit, which :func:`freeze_heap_at_exit` skips. ``dvc repro`` waits for every stage process, and a stage for every
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
    reference counting, but an object in a reference cycle left at exit is never finalized (no
    ``__del__``, weakref callback, buffered flush or socket close), and module globals are cleared
    before what finalizers remain run. So no cleanup may rely on collection at exit: outputs are
    written, closed and renamed before a stage returns, a stage stops its judge server and removes
    its temporary directories itself, and ``weakref.finalize``, logging, thread pools and
    multiprocessing clean up through ``atexit`` hooks of their own, which run either way. In a test
    process it takes effect when that process exits.
    """
    global _registered
    if not _registered:
        atexit.register(gc.freeze)
        _registered = True
