"""Triton's model-repository API over HTTP: which models it knows and in what state, and loading one.

These are restricted APIs on a server started with an admin key (serve.security.RESTRICTED_APIS):
`TritonAdmin` sends the key's header on every call, and a refusal for want of the right key is an
`AdminKeyError` that says which.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass

from scorestack.errors import AdminKeyError, ServerError
from scorestack.serve.security import ADMIN_KEY_HEADER, AdminKey


@dataclass(frozen=True)
class ModelStatus:
    """Whether one model of the repository is being served, and if not, why."""

    name: str
    ready: bool
    versions: tuple[str, ...] = ()
    reason: str = ""


def first_line(text: str) -> str:
    """The first non-blank line of one of Triton's messages, at most 600 characters."""
    return next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")[:600]


class TritonAdmin:
    """Admin calls to the Triton whose HTTP frontend is at `http_url` (host:port)."""

    def __init__(self, http_url: str, admin_key: AdminKey | None = None) -> None:
        self.http_url = http_url
        self.admin_key = admin_key

    def request(self, method: str, path: str, body: dict | None = None, timeout_s: float = 10.0) -> tuple[int, object]:
        """(HTTP status, decoded JSON answer) of one call; raises AdminKeyError when Triton refuses it as restricted."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(self.admin_key.http_headers if self.admin_key else {})}
        req = urllib.request.Request(f"http://{self.http_url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                raw = r.read()
                return r.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            raw = exc.read()
            try:
                code, answer = exc.code, json.loads(raw)
            except ValueError:
                code, answer = exc.code, {"error": raw.decode(errors="replace")}
            if code == 403 and "restricted" in str(answer).lower():
                raise AdminKeyError(f"Triton at {self.http_url} refused {path}: {'the admin key is wrong' if self.admin_key else 'no admin key was sent'} (header {ADMIN_KEY_HEADER!r})") from exc
            return code, answer

    def repository_index(self) -> dict[str, ModelStatus]:
        """Every model Triton knows of, with its state and Triton's reason when it is not ready."""
        code, entries = self.request("POST", "/v2/repository/index", {})
        if code != 200 or not isinstance(entries, list):
            raise ServerError(f"Triton at {self.http_url} answered its repository index with {code}: {str(entries)[:500]}")
        out: dict[str, dict] = {}
        for e in entries or []:
            d = out.setdefault(e["name"], {"versions": [], "reasons": [], "ready": False})
            if e.get("state") == "READY":
                d["ready"] = True
                d["versions"].append(str(e.get("version", "")))
            elif e.get("reason"):
                d["reasons"].append(first_line(e["reason"]))
        return {
            name: ModelStatus(name, d["ready"], tuple(sorted(d["versions"], key=lambda v: int(v) if v.isdigit() else 0)), "; ".join(dict.fromkeys(d["reasons"])))
            for name, d in out.items()
        }

    def load(self, name: str, timeout_s: float = 120.0) -> ModelStatus:
        """Ask Triton to load `name` from its repository (explicit model control) and return its status
        after: the new versions when they loaded, else what still serves with Triton's reason."""
        code, body = self.request("POST", f"/v2/repository/models/{name}/load", {}, timeout_s=timeout_s)
        current = self.repository_index().get(name)
        if code == 200 and current is not None and current.ready:
            return current
        err = body.get("error") if isinstance(body, dict) else str(body)
        return ModelStatus(name, bool(current and current.ready), current.versions if current else (), first_line(err or "load failed"))
