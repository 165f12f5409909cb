"""RuntimeWorker: the compiler's handle on a verification worker running in the server environment.

One worker process per compile job (not one per candidate). Every call has a deadline; a worker
that crashes (a library segfault while loading a candidate) or hangs is killed and reported with
its exit code and log tail, and the next call starts a fresh one.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from scorestack.errors import ServerError
from scorestack.serve.environment import ServerEnvironment, ensure_server_environment
from scorestack.serve.runtime.worker import read_frame, write_frame


class WorkerError(ServerError):
    """The worker crashed, hung, or refused a command; the message says which and why."""


def worker_script() -> Path:
    return Path(str(resources.files("scorestack.serve.runtime") / "worker.py"))


class RuntimeWorker:
    """Runs `serve/runtime/worker.py` under `python` (default: the server environment's).

    >>> with RuntimeWorker() as w:
    ...     w.load("onnx", "fraud", version_dir, config_dict)
    ...     out, errors = w.execute("onnx", X, sizes=[1] * len(X))
    """

    def __init__(self, env: ServerEnvironment | None = None, *, python: str | None = None, timeout_s: float = 300.0) -> None:
        self._env = env
        self._python = python
        self.timeout_s = timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._replies: queue.Queue[Any] = queue.Queue()
        self._log = tempfile.TemporaryFile()
        self.info: dict[str, Any] = {}
        self.loaded: set[str] = set()  # keys loaded in the current worker process

    # -- lifecycle -----------------------------------------------------------------------------
    def __enter__(self) -> "RuntimeWorker":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._python is not None:
            python, env = self._python, dict(os.environ)
        else:
            server_env = self._env or ensure_server_environment()
            python, env = str(server_env.python), server_env.launch_env()
        self.python = python
        self.proc = subprocess.Popen(
            [python, str(worker_script())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
        )
        self._replies = queue.Queue()
        self.loaded = set()
        threading.Thread(target=self._reader, args=(self.proc, self._replies), daemon=True).start()
        hello = self._call({"op": "hello"}, timeout_s=120)[0]
        self.info = {k: v for k, v in hello.items() if k not in ("ok", "blobs")}

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:  # ask it to quit; kill it if it does not
            try:
                write_frame(proc.stdin, {"op": "quit"})
                proc.wait(5)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                proc.kill()
                proc.wait(5)

    @staticmethod
    def _reader(proc: subprocess.Popen[bytes], replies: "queue.Queue[Any]") -> None:
        try:
            while True:
                replies.put(read_frame(proc.stdout))
        except Exception as exc:  # EOF or a torn frame: the worker is gone
            replies.put(exc)

    def _log_tail(self, n: int = 1500) -> str:
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return text[-n:].strip()

    def _call(self, header: dict[str, Any], arrays: tuple[np.ndarray, ...] = (), timeout_s: float | None = None) -> tuple[dict[str, Any], list[np.ndarray]]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None
        try:
            write_frame(self.proc.stdin, header, arrays)
            reply = self._replies.get(timeout=timeout_s or self.timeout_s)
        except queue.Empty:
            self._kill()
            raise WorkerError(f"the server-environment worker did not answer `{header['op']}` within {timeout_s or self.timeout_s:.0f} s and was stopped") from None
        except (BrokenPipeError, OSError):
            reply = EOFError()
        if isinstance(reply, Exception):
            code = self.proc.wait(10) if self.proc else None
            self.proc = None
            raise WorkerError(f"the server-environment worker exited (code {code}) during `{header['op']}`: {self._log_tail() or 'no output'}")
        msg, blobs = reply
        if not msg.get("ok"):
            raise WorkerError(msg.get("error") or "unknown worker error")
        return msg, blobs

    def _kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None

    # -- commands ------------------------------------------------------------------------------
    def load(self, key: str, name: str, version_dir: Path, config: dict[str, Any], timeout_s: float = 300.0) -> float:
        """Load a model version as Triton's Python backend would; returns load seconds. Raises WorkerError with the reason."""
        msg, _ = self._call({"op": "load", "key": key, "name": name, "version_dir": str(version_dir), "config": config}, timeout_s=timeout_s)
        self.loaded.add(key)
        return float(msg["load_s"])

    def unload(self, key: str) -> None:
        self._call({"op": "unload", "key": key})
        self.loaded.discard(key)

    def execute(self, key: str, X: np.ndarray, sizes: list[int]) -> tuple[np.ndarray, dict[int, str]]:
        """Execute X split into requests of `sizes` rows as one batcher call; returns (outputs [n, k] float64, {request: error})."""
        if sum(sizes) != len(X):
            raise ValueError(f"request sizes sum to {sum(sizes)} but X has {len(X)} rows")
        msg, (out,) = self._call({"op": "execute", "key": key, "sizes": [int(s) for s in sizes]}, (X,))
        return out, {int(k): v for k, v in msg["errors"].items()}

    def measure(
        self,
        keys: list[str],
        X: np.ndarray,
        batch_sizes: list[int],
        *,
        rounds: int = 3,
        cell_budget_s: float = 0.05,
        max_calls: int = 400,
        min_calls: int = 3,
        seed: int = 0,
    ) -> dict[str, dict[int, float]]:
        """Median µs per call for each loaded model and batch size, in interleaved rounds."""
        budget = 120 + rounds * len(keys) * len(batch_sizes) * (cell_budget_s + 0.5) * 4
        msg, _ = self._call(
            {
                "op": "measure",
                "keys": keys,
                "batch_sizes": [int(b) for b in batch_sizes],
                "rounds": rounds,
                "cell_budget_s": cell_budget_s,
                "max_calls": max_calls,
                "min_calls": min_calls,
                "seed": seed,
            },
            (X,),
            timeout_s=budget,
        )
        return {k: {int(b): v for b, v in per.items()} for k, per in msg["table"].items()}


def project_python_worker() -> RuntimeWorker:
    """A worker in this (project) environment: only where no server environment exists; the report says so."""
    return RuntimeWorker(python=sys.executable)

