"""Ending a process without the interpreter's teardown: a rank of the runtime, `hpctrain validate`.

Python's finalization (after atexit) runs a last full garbage collection and frees every module. With
torch loaded that took 1-7 s of a 2-rank CPU run (py-spy: `gc_collect_main`), every run's time between
its `finished` and `ended` events; after `hpctrain validate` it frees the ~30k objects of the job schema,
~3 ms of a command that takes ~0.14 s (issue 23 item 8). What of the teardown has effects is done first,
in the interpreter's own order (Python/pylifecycle.c, Py_FinalizeEx: wait for threads, then atexit,
then flush the standard streams); the rest is what os._exit skips.
"""

import os
import sys
from typing import NoReturn


def exit_now(code: int, *, wait: bool = True) -> NoReturn:
    """Wait for non-daemon threads and run the atexit handlers (trackers, logging, weakref.finalize), unless
    `wait` is false; flush stdout/stderr; end the process with `code`. A failed rank passes wait=False:
    other ranks may be stuck in a collective, so it never waits in process-group teardown."""
    import atexit
    import threading

    if wait:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be said on it
            pass
    os._exit(code)
