"""Errors shared by every stage; each names what was wrong and how to fix it."""

from __future__ import annotations


class ScorestackError(Exception):
    """Base class for every error scorestack raises on purpose."""


class ConfigError(ScorestackError):
    """A Triton model configuration (config.pbtxt) is invalid."""


class SpecError(ScorestackError):
    """A model spec (YAML) is invalid; the message names the field and the fix."""


class PlatformError(ScorestackError):
    """The local Triton cannot run on this machine (OS, architecture, glibc)."""


class ServerError(ScorestackError):
    """The local Triton server failed to start, stopped, or is not ready."""


class VerificationError(ScorestackError):
    """A compiled artifact does not reproduce its source model."""


class FeatureError(ScorestackError):
    """A feature fetch was asked something invalid (unknown service, bad entity rows)."""


class InferenceError(ScorestackError):
    """An inference request failed; the message names the model."""


class OverloadedError(InferenceError):
    """The request was shed: Triton refused it by its queue policy (queued past its timeout, or queue
    full), or, with ``local`` true, the client's own in-flight limit refused it before it was sent
    (``TritonClient(max_in_flight=...)``), so the server never saw it.

    Not retried: it is load shedding by design; retrying would add load and hide it.
    """

    def __init__(self, message: str, *, local: bool = False) -> None:
        super().__init__(message)
        self.local = local


class RequestValidationError(ScorestackError):
    """A scoring request is invalid; ``field`` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class AdminKeyError(ServerError):
    """An admin call (model load/unload, statistics, trace, logging, shared memory) was refused or
    cannot be made: the admin key is missing, wrong, or badly formed. The message says which.
    A ServerError, so callers that handle a failed hot-swap handle a refused one too."""


class TlsError(ScorestackError):
    """A TLS connection to Triton failed: plaintext against TLS (or the reverse), a certificate not
    signed by the trusted CA, an expired certificate, or a missing client certificate under mutual
    TLS. The message says which and what to pass."""


class InputValidationError(FeatureError, RequestValidationError):
    """An entity id, entity row or request field is invalid (scorestack.validation, the one rule
    shared by the fetch layer and the request paths); ``field`` names it. Caught as either parent."""

    def __init__(self, field: str, message: str) -> None:
        RequestValidationError.__init__(self, field, message)


class FeatureServiceError(FeatureError):
    """A feature service cannot be served as numeric model inputs (e.g. it outputs a String or Map
    feature); the message names the service, the feature and its type. Other services still work."""
