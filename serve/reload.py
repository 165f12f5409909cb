"""Hot swap: load what changed in a model repository into the Triton that serves it.

A model's fingerprint is its config.pbtxt's modification time and, per version folder, that of its
manifest (SHA256SUMS) or of the folder. `RepositoryWatcher.sync` re-renders each model whose
fingerprint changed since the last look into the local view (serve.view.render_model) and asks
Triton to load it (serve.admin); with an interval, a thread runs it while the server runs.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from scorestack.errors import ConfigError
from scorestack.serve.admin import ModelStatus, TritonAdmin
from scorestack.serve.view import render_model

log = logging.getLogger(__name__)


def fingerprint(model_dir: Path) -> tuple:
    """What a change to the model in `model_dir` changes: (None,) while it has no config."""
    try:
        config = (model_dir / "config.pbtxt").stat().st_mtime_ns
    except OSError:
        return (None,)
    versions = []
    for p in model_dir.iterdir():
        if p.is_dir() and p.name.isdigit():
            try:
                versions.append((p.name, (p / "SHA256SUMS").stat().st_mtime_ns if (p / "SHA256SUMS").exists() else p.stat().st_mtime_ns))
            except OSError:
                pass
    return (config, tuple(sorted(versions)))


class RepositoryWatcher:
    """Loads changed models of `repository` into the Triton serving its local view at `view_root`.

    `admin` gives the client of that Triton at the time of the call (its ports are picked at start);
    `seen` are the fingerprints of what the view was built from; `on_status(name, status)` records
    each reload's outcome. `models`, when given, limits the watch to those models.
    """

    def __init__(
        self,
        repository: Path,
        view_root: Path,
        admin: Callable[[], TritonAdmin],
        *,
        seen: dict[str, tuple],
        on_status: Callable[[str, ModelStatus], None],
        models: list[str] | None = None,
    ) -> None:
        self.repository = repository
        self.view_root = view_root
        self.models = models
        self._admin = admin
        self._on_status = on_status
        self._fingerprints = dict(seen)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def reload(self, name: str, timeout_s: float = 120.0) -> ModelStatus:
        """Re-render `name` from the repository and ask Triton to load it (explicit model control).

        Triton loads the new versions while the old ones keep serving, then retires versions the
        version policy no longer lists once their requests are done. Returns the model's status;
        a failed load leaves whatever was serving in place and reports Triton's reason.
        """
        with self._lock:
            # What is about to be rendered, taken before rendering: a version installed while this
            # one renders and loads (a load takes seconds) then differs at the next look and is
            # loaded then. Taken after the load, it would mark that version as already seen.
            seen = fingerprint(self.repository / name)
            try:
                reason = render_model(self.repository / name, self.view_root)
            except ConfigError as exc:
                reason = str(exc)
            if reason is not None:
                st = ModelStatus(name, False, reason=f"not served locally: {reason}")
            else:
                st = self._admin().load(name, timeout_s=timeout_s)
            self._fingerprints[name] = seen
            self._on_status(name, st)
            return st

    def sync(self) -> dict[str, ModelStatus]:
        """Load what changed in the repository since the last look (a new version, a new or edited model)."""
        changed = {}
        for model_dir in sorted(p for p in self.repository.iterdir() if p.is_dir() and not p.name.startswith(".")):
            name = model_dir.name
            if self.models is not None and name not in self.models:
                continue
            fp = fingerprint(model_dir)
            if fp != self._fingerprints.get(name) and fp[0] is not None:
                st = self.reload(name)
                changed[name] = st
                log.warning("model %s reloaded from %s: %s", name, self.repository, "ready, versions " + ",".join(st.versions) if st.ready else st.reason)
        return changed

    def start(self, interval_s: float, is_running: Callable[[], bool]) -> None:
        """Sync every `interval_s` in a daemon thread until stop(), or until `is_running()` is false."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, args=(interval_s, is_running), name="scorestack-repository-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        self._thread = None

    def _watch(self, interval_s: float, is_running: Callable[[], bool]) -> None:
        while not self._stop.wait(interval_s or 1.0):
            if not is_running():
                return
            try:
                self.sync()
            except Exception:  # a failed look is logged and retried at the next tick
                log.exception("repository sync failed")
