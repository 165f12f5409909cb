"""Ports for servers: picked free now, and reserved against every other scorestack process.

`PortReservation` is what a server of this process takes for itself (LocalTriton) and releases when
it stops; `free_ports` is for ports another process will bind (e.g. a `scorestack serve` a caller
starts): they stay reserved until this process exits.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import Collection

from scorestack import paths


def free_port(host: str = "127.0.0.1") -> int:
    """One port free now. For several, use free_ports: a port released by one pick can be the next pick."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", *, exclude: Collection[int] = ()) -> list[int]:
    """`n` distinct ports free now, none in `exclude`, for another process to bind (e.g. the ports of a
    `scorestack serve` a caller starts): reserved against other scorestack processes (PortReservation)
    until this process exits. A server of this process reserves its own (LocalTriton)."""
    reservation = PortReservation.take(n, host, exclude=exclude)
    _KEPT.append(reservation)
    return reservation.ports


_KEPT: list["PortReservation"] = []


class PortReservation:
    """Ports picked for one server and reserved against every other scorestack process until released.

    A picked port is free only until someone binds it. Two scorestack processes starting servers at
    once (parallel compile jobs' serving checks, parallel test workers) can be handed the same port,
    and Triton's metrics endpoint binds with SO_REUSEPORT: a second server then *shares* the first
    one's metrics port without an error, and scrapes reach either (measured here). Each reserved
    port holds an exclusive lock on a file named after it under scorestack's home; other scorestack
    processes skip locked ports, and the kernel drops the locks of a process that dies.
    """

    def __init__(self, ports: list[int], locks: list[int]) -> None:
        self.ports = ports
        self._locks = locks

    @staticmethod
    def directory() -> Path:
        # Machine-wide state, like the server environment (not $TMPDIR, which callers set per run).
        path = paths.home() / "ports"
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        return path

    @classmethod
    def take(cls, n: int, host: str = "127.0.0.1", *, exclude: Collection[int] = ()) -> "PortReservation":
        """`n` distinct ports, none in `exclude` or reserved by another scorestack process.

        Each socket stays bound until all are picked: picked and released one at a time, the kernel
        hands out the same port again (seen in CI: Triton refused "HTTP and metrics at the same
        address and port" and exited before it was ready)."""
        held: list[socket.socket] = []
        ports: list[int] = []
        locks: list[int] = []
        folder = cls.directory()
        try:
            while len(ports) < n:
                s = socket.socket()
                held.append(s)  # stays bound until every port is picked, so none is picked twice
                s.bind((host, 0))
                port = s.getsockname()[1]
                if port in exclude:
                    continue
                fd = os.open(folder / str(port), os.O_CREAT | os.O_RDWR, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # reserved elsewhere: its server has it or is about to bind it
                    os.close(fd)
                    continue
                locks.append(fd)
                ports.append(port)
        except BaseException:
            for fd in locks:
                os.close(fd)
            raise
        finally:
            for s in held:
                s.close()
        return cls(ports, locks)

    def release(self) -> None:
        for fd in self._locks:
            os.close(fd)
        self._locks = []
