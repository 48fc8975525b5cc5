"""Clean-up when the training process is terminated by a signal.

SIGINT raises KeyboardInterrupt and the loaders close on the way out (``with``,
``Loader.close`` or the atexit hook). SIGTERM's default action ends the process at once,
without atexit, leaving /dev/shm segments (which outlive processes) and workers busy on a
sample. So, where SIGTERM still has its default action, a handler cleans up first and then dies
by SIGTERM all the same (the exit status a job scheduler expects). A handler the application
installs later replaces it; one that calls it in turn (Lightning chains the handler it finds)
finds it inert: the application handles SIGTERM then.
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


def _on_sigterm(signum: int, frame: Any) -> None:
    # This runs in the main thread between two bytecodes, perhaps while it holds a lock that
    # an orderly close would need: take no lock, join nothing.
    if signal.getsignal(signal.SIGTERM) is not _on_sigterm:
        # A handler installed after ours calls it (Lightning's signal connector chains the
        # handler it found): the application handles SIGTERM (Lightning raises
        # SIGTERMException at the next step, its SLURM requeue ignores the signal), and its
        # exit path closes the loaders, as when it installed its handler first. Dying here
        # would skip it (trial 145: exit status 143, no on_exception, no finally).
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
