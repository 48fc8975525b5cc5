"""Suite-wide hygiene: threads a test leaves behind.

A loader forks its workers from this process only while it runs one thread
(``autominato.pipeline.spawn.can_fork_now``); otherwise it starts them from a new interpreter
(~2.5 s importing torch). One thread left running by a test therefore slows every later test
that builds a loader (in one full run a read thread left running sent ~290 later tests to
new interpreters: 599 s, where ~450 s is usual). After each test (and its
fixtures) this waits briefly for the loader threads it started to end and lists, at the end of the run,
the tests that left some behind, with what each thread was doing.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

import pytest

#: How long a test's loader threads may take to end after it (a hung read abandoned after its
#: timeout sleeps on in the dataset's code, then ends by itself), seconds.
_GRACE_S = 2.0
_left: list[str] = []


def _ours(before: set[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith("autominato-") and t.is_alive() and t not in before]


@pytest.fixture(autouse=True)
def _no_loader_thread_left(request):
    before = set(threading.enumerate())  # a module's fixture may hold a loader for its tests
    yield
    deadline = time.monotonic() + _GRACE_S
    while _ours(before) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = _ours(before)
    if left:
        frames = sys._current_frames()
        where = []
        for t in left:
            stack = traceback.format_stack(frames[t.ident])[-2:] if t.ident in frames else []
            where.append(f"  {t.name}:\n" + "".join("    " + line for s in stack
                                                     for line in s.splitlines(True)))
        _left.append(f"{request.node.nodeid}: {len(left)} thread(s)\n" + "".join(where))


def pytest_terminal_summary(terminalreporter):
    if _left:
        terminalreporter.section("loader threads left running after a test")
        for line in _left:
            terminalreporter.write_line(line)
