"""The one process meter, against known quantities: a child that burns a known CPU time and
allocates a known number of bytes when told to."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from autominato.telemetry.process import ProcessMeter

MiB = 1 << 20

# Reads commands on stdin, answers "done" to each once it has been carried out.
CHILD = """
import subprocess, sys, time
import numpy as np
held = []
print("ready", flush=True)
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "burn":  # this much CPU time, in seconds
        end = time.process_time() + float(arg)
        while time.process_time() < end:
            pass
    elif cmd == "alloc":  # this many bytes, every page written
        held.append(np.ones(int(arg), np.uint8))
    elif cmd in ("shm", "shmmap"):  # this many bytes written into a memory file; "shm":
        import mmap, os                 # unmapped, only its descriptor kept open
        fd = os.memfd_create("test")
        os.ftruncate(fd, int(arg))
        m = mmap.mmap(fd, int(arg))
        m.write(b"x" * int(arg))
        if cmd == "shm":
            m.close()
        held.append((fd, m))
    elif cmd == "spawn":  # a child of its own that burns this much CPU, then sleeps
        code = (
            f"import time\\nwhile time.process_time() < {float(arg)}: pass\\n"
            "print('burned', flush=True)\\ntime.sleep(60)"
        )
        kid = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        kid.stdout.readline()
    elif cmd == "reap":  # the child of its own exits
        kid.kill()
        kid.wait()
    print("done", flush=True)
"""


class Child:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "ready"

    def do(self, cmd: str, arg: float) -> None:
        self.proc.stdin.write(f"{cmd} {arg}\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "done"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def child():
    c = Child()
    yield c
    c.close()


def test_cpu_seconds_grow_by_the_cpu_time_the_process_burned(child):
    meter = ProcessMeter(child.proc.pid)
    before = meter.read()
    child.do("burn", 0.5)
    after = meter.read()
    # /proc counts CPU in clock ticks (10 ms); the loop stops at the first tick past 0.5 s and
    # reading its command and answering costs a little more.
    assert 0.48 <= after.cpu_seconds_total - before.cpu_seconds_total <= 1.0
    assert after.time > before.time
    assert [p.pid for p in after.processes] == [child.proc.pid] and after.processes[0].root


def test_memory_grows_by_the_bytes_the_process_wrote(child):
    meter = ProcessMeter(child.proc.pid, pss=True)
    before = meter.read().processes[0]
    child.do("alloc", 64 * MiB)
    after = meter.read().processes[0]
    for field in ("rss_bytes", "private_bytes", "pss_bytes"):
        grown = getattr(after, field) - getattr(before, field)
        assert 60 * MiB <= grown <= 72 * MiB, (field, grown / MiB)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="no memfd_create")
def test_the_footprint_counts_shared_memory_that_no_process_maps_once(child):
    meter = ProcessMeter(child.proc.pid, pss=True)
    before = meter.read()
    child.do("shm", 64 * MiB)  # written, unmapped, kept: a batch sent and not yet read
    unmapped = meter.read()
    # PSS sees no page of it; the footprint sees the machine's shared memory grow.
    assert unmapped.pss_bytes - before.pss_bytes < 8 * MiB
    assert 60 * MiB <= unmapped.footprint_bytes - before.footprint_bytes <= 72 * MiB
    child.do("shmmap", 64 * MiB)  # written and kept mapped: in PSS, counted once
    mapped = meter.read()
    assert 60 * MiB <= mapped.pss_bytes - unmapped.pss_bytes <= 72 * MiB
    assert 60 * MiB <= mapped.footprint_bytes - unmapped.footprint_bytes <= 72 * MiB
    assert mapped.processes[0].shmem_pss_bytes >= 60 * MiB


def test_pss_is_read_only_when_asked_for(child):
    r = ProcessMeter(child.proc.pid).read()
    assert r.processes[0].pss_bytes is None
    assert r.pss_bytes == r.processes[0].rss_bytes  # RSS stands in
    assert r.shmem_gained_bytes is None and r.footprint_bytes == r.pss_bytes


def test_a_listed_worker_counts_as_a_worker_and_its_cpu_outlives_it(child):
    meter = ProcessMeter()  # this process is the root, the child a listed worker
    before = meter.read([child.proc.pid])
    assert [p.pid for p in before.workers] == [child.proc.pid]
    assert before.processes[0].pid == os.getpid() and before.processes[0].root
    child.do("alloc", 32 * MiB)
    child.do("burn", 0.3)
    mid = meter.read([child.proc.pid])
    assert mid.worker_private_bytes - before.worker_private_bytes >= 30 * MiB
    assert mid.cpu_seconds_total - before.cpu_seconds_total >= 0.28
    child.close()
    gone = meter.read([child.proc.pid])
    assert gone.workers == () and gone.cpu_seconds_total >= mid.cpu_seconds_total


def test_children_brings_in_the_whole_tree_and_an_exited_grandchild_keeps_its_cpu(child):
    meter = ProcessMeter(child.proc.pid, children=True)
    assert [p.pid for p in meter.read().processes] == [child.proc.pid]
    child.do("spawn", 0.4)
    tree = meter.read()
    assert len(tree.processes) == 2 and len(tree.workers) == 1
    assert tree.workers[0].cpu_s >= 0.38
    child.do("reap", 0)
    gone = meter.read()
    assert [p.pid for p in gone.processes] == [child.proc.pid]
    assert gone.cpu_seconds_total >= tree.cpu_seconds_total  # the grandchild's CPU stays


def test_a_process_that_does_not_exist_is_an_error():
    c = subprocess.Popen([sys.executable, "-c", "pass"])
    c.wait()
    with pytest.raises(psutil.NoSuchProcess):
        ProcessMeter(c.pid)
