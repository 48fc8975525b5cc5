"""Clean-up when the training process is terminated by a signal.

SIGINT raises KeyboardInterrupt and the loaders close on the way out (``with``,
``Loader.close`` or the atexit hook). SIGTERM's default action ends the process at once,
without atexit, leaving /dev/shm segments (which outlive processes) and workers busy on a
sample. So, where SIGTERM still has its default action, a handler cleans up first and then dies
by SIGTERM all the same (the exit status a job scheduler expects). A handler the application
installs later replaces it; called by Lightning's (which chains the handler it finds, and
goes on: ``SIGTERMException`` at the next step) it does nothing, as Lightning handles SIGTERM.
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from typing import Any

from autominato.pipeline.shm import SHM_DIR, leftover_segments

live: weakref.WeakSet = weakref.WeakSet()
_installed_in: int | None = None  # pid of the process whose SIGTERM handler is ours


def install() -> None:
    global _installed_in
    if _installed_in == os.getpid() or threading.current_thread() is not threading.main_thread():
        return  # signal handlers can be set only from the main thread
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the application handles SIGTERM itself (and its exit path closes loaders)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _installed_in = os.getpid()


def _graceful(handler: Any) -> bool:
    """``handler`` is Lightning's chain of SIGTERM handlers (``_HandlersCompose`` of
    ``lightning.pytorch`` or ``pytorch_lightning``), which goes on after calling ours. Any
    other handler that calls ours expects what ours did before it (clean up, then die by
    SIGTERM): a handler that chains and then returns would have its SIGTERM swallowed, one
    that exits would leave the segments (review 148)."""
    kind = type(handler)
    return kind.__name__ == "_HandlersCompose" and kind.__module__.startswith(
        ("lightning.pytorch.", "pytorch_lightning."))


def _on_sigterm(signum: int, frame: Any) -> None:
    # This runs in the main thread between two bytecodes, perhaps while it holds a lock that
    # an orderly close would need: take no lock, join nothing.
    if _graceful(signal.getsignal(signal.SIGTERM)):
        # Lightning's handler, installed after ours, calls it (its signal connector chains
        # the handler it found): Lightning handles SIGTERM (SIGTERMException at the next
        # step, its SLURM requeue ignores the signal), and its exit path closes the loaders.
        # Dying here would skip it (trial 145: exit status 143, no on_exception, no finally).
        return
    if os.getpid() == _installed_in:  # not in a child forked after installing
        for p in list(live):
            try:
                p.kill_workers()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        for name in leftover_segments(os.getpid()):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
