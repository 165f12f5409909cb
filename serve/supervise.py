"""The server process's life as a child of scorestack: tagged with its supervisor, tied to it, pinned to CPUs.

Every tritonserver scorestack starts (and its Python-backend stubs, which inherit the environment)
carries `SUPERVISOR_ENV` naming the process that started it (`supervisor_tag`), so a later start can
find and stop the orphans of a supervisor that died (`clean_leftovers`). `child_setup` runs in the
child before exec: the CPU set the server may use (`parse_cpus`) and the parent-death signal.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import signal
from pathlib import Path
from typing import Collection

from scorestack.errors import ConfigError

log = logging.getLogger(__name__)

SUPERVISOR_ENV = "SCORESTACK_SUPERVISOR"
_PR_SET_PDEATHSIG = 1


def _process_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def supervisor_tag(pid: int) -> str:
    """The value of SUPERVISOR_ENV naming process `pid`: its pid and start time (a reused pid is another process)."""
    return f"{pid}:{_process_start_time(pid)}"


def _supervisor_alive(tag: str) -> bool:
    pid, _, start = tag.partition(":")
    return pid.isdigit() and _process_start_time(int(pid)) == start


def clean_leftovers() -> list[int]:
    """Stop tritonservers and stubs whose supervising scorestack process is gone, and remove their
    shared-memory regions. Returns the pids stopped."""
    killed = []
    me = os.getuid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}").st_uid != me:
                continue
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        tag = next((v.split(b"=", 1)[1].decode() for v in env if v.startswith(SUPERVISOR_ENV.encode() + b"=")), None)
        if tag and not _supervisor_alive(tag):
            try:
                os.kill(int(entry), signal.SIGKILL)
                killed.append(int(entry))
            except OSError:
                pass
    for path in glob.glob("/dev/shm/scorestack_*_*"):
        owner = Path(path).name.split("_")[1]
        if owner.isdigit() and _process_start_time(int(owner)) is None:
            try:
                os.unlink(path)
            except OSError:
                pass
    if killed:
        log.warning("stopped %d leftover Triton processes of a scorestack run that died: %s", len(killed), killed)
    return killed


def _die_with_parent(parent: int):
    """In the child before exec: SIGKILL when the parent dies (Linux parent-death signal)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def setup() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return setup


def parse_cpus(cpus: "Collection[int] | str", *, field: str = "cpus") -> frozenset[int]:
    """A CPU set for the server: ints, or a list like "1", "0,2" or "2-3", each CPU one this process may use.

    On a machine shared by the server and its callers, a server confined to its own cores wakes its
    threads (gRPC frontend, batcher, model instances) on one core instead of across cores; on the
    2-core project machine that took the fraud model call at concurrency 1 (queue + compute +
    network phases) from 0.59-0.61 to 0.40-0.44 ms (benchmarks/results/request_path.md).
    """
    if isinstance(cpus, str):
        chosen: set[int] = set()
        try:
            for part in (p.strip() for p in cpus.split(",")):
                if "-" in part:
                    lo, hi = (int(x) for x in part.split("-", 1))
                    if hi < lo:
                        raise ValueError(part)
                    chosen.update(range(lo, hi + 1))
                elif part:
                    chosen.add(int(part))
        except ValueError:
            raise ConfigError(f"{field}: {cpus!r} is not a CPU list; write e.g. \"1\", \"0,2\" or \"2-3\"") from None
    else:
        chosen = {int(c) for c in cpus}
    allowed = os.sched_getaffinity(0)
    if not chosen:
        raise ConfigError(f"{field}: empty; name at least one of the CPUs this process may use ({_cpu_list(allowed)})")
    outside = sorted(chosen - allowed)
    if outside:
        raise ConfigError(f"{field}: CPUs {outside} are not available to this process; choose among {_cpu_list(allowed)}")
    return frozenset(chosen)


def _cpu_list(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def child_setup(parent: int | None, cpus: frozenset[int] | None):
    """In the child before exec: the CPU set (every thread and process it starts inherits it), and
    the parent-death signal when `parent` is given."""
    die = _die_with_parent(parent) if parent is not None else None

    def setup() -> None:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if die is not None:
            die()

    return setup
