"""Who may change the models and who may listen: the admin key (from env or file), the APIs it guards, TLS files.

One place for the names the server, the command line, the clients and the deployments share:
the key's environment variables and header, and the Triton API categories it restricts.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from scorestack.errors import AdminKeyError, TlsError

log = logging.getLogger(__name__)

ADMIN_KEY_ENV = "SCORESTACK_ADMIN_KEY"
ADMIN_KEY_FILE_ENV = "SCORESTACK_ADMIN_KEY_FILE"
# A directory with ca.crt (and client.crt/client.key for mutual TLS): how scorestack's own client
# commands (hot-swap, diagnose) reach a TLS Triton without a flag of their own.
TLS_DIR_ENV = "SCORESTACK_TLS_DIR"
# The header Triton is told to check (lowercase: gRPC metadata keys must be). Over HTTP it is sent
# as is; over gRPC Triton 2.51 looks for it under the prefix "triton-grpc-protocol-" (seen: "This
# protocol is restricted, expecting header 'triton-grpc-protocol-scorestack-admin-key'").
ADMIN_KEY_HEADER = "scorestack-admin-key"
GRPC_ADMIN_KEY_HEADER = f"triton-grpc-protocol-{ADMIN_KEY_HEADER}"

# Triton's restricted-API categories the key guards (same names for --grpc-restricted-protocol and
# --http-restricted-api). Left open on purpose: health, metadata, inference (serving), and
# model-config: it is read-only (a config changes only through the repository API, guarded here),
# and the request path reads its decision threshold and max_batch_size from it, so restricting it
# would hand every scoring service the key that swaps models.
RESTRICTED_APIS: tuple[str, ...] = ("model-repository", "shared-memory", "statistics", "trace", "logging")
OPEN_APIS: tuple[str, ...] = ("health", "metadata", "inference", "model-config")

MIN_KEY_LENGTH = 16
# Triton splits the flag on ':' and '=' and gRPC metadata values must be printable ASCII: keep keys
# to URL-safe characters (what `secrets.token_urlsafe` produces).
_KEY_CHARS = re.compile(r"^[A-Za-z0-9_\-.~]+$")
HOW_TO_MAKE_A_KEY = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'


@dataclass(frozen=True)
class AdminKey:
    """The shared secret that unlocks Triton's restricted APIs; never printed (repr hides it)."""

    value: str = field(repr=False)
    source: str = "argument"  # where it came from, for messages: an env var name or a file path

    def __post_init__(self) -> None:
        if len(self.value) < MIN_KEY_LENGTH or not _KEY_CHARS.match(self.value):
            raise AdminKeyError(
                f"admin key from {self.source}: must be at least {MIN_KEY_LENGTH} URL-safe characters "
                f"(letters, digits, '-', '_', '.', '~'); make one with {HOW_TO_MAKE_A_KEY}"
            )

    @property
    def grpc_headers(self) -> dict[str, str]:
        """gRPC metadata that carries the key on an admin call (tritonclient's `headers=`)."""
        return {GRPC_ADMIN_KEY_HEADER: self.value}

    @property
    def http_headers(self) -> dict[str, str]:
        """HTTP headers that carry the key on an admin call."""
        return {ADMIN_KEY_HEADER: self.value}

    def triton_args(self, apis: tuple[str, ...] = RESTRICTED_APIS) -> list[str]:
        """tritonserver flags restricting `apis` on gRPC and HTTP to callers sending this key.

        Triton only takes the key on its command line: whoever can list this machine's processes
        with their arguments can read it (see the README's threat model).
        """
        spec = f"{','.join(apis)}:{ADMIN_KEY_HEADER}={self.value}"
        return [f"--grpc-restricted-protocol={spec}", f"--http-restricted-api={spec}"]


def load_admin_key(explicit: "AdminKey | str | os.PathLike[str] | None" = None, *, environ: Mapping[str, str] | None = None) -> AdminKey | None:
    """The admin key: `explicit` (a key, or a Path to a key file), else $SCORESTACK_ADMIN_KEY, else the
    file named by $SCORESTACK_ADMIN_KEY_FILE; None when none is configured.

    Never read from a command-line value: arguments are visible to every user through `ps`.
    """
    env = os.environ if environ is None else environ
    if isinstance(explicit, AdminKey):
        return explicit
    if isinstance(explicit, os.PathLike):
        return _read_key_file(Path(explicit), source=str(explicit))
    if isinstance(explicit, str):
        return AdminKey(explicit.strip(), "argument")
    value = env.get(ADMIN_KEY_ENV)
    path = env.get(ADMIN_KEY_FILE_ENV)
    if value and path:
        raise AdminKeyError(f"both {ADMIN_KEY_ENV} and {ADMIN_KEY_FILE_ENV} are set; set only one")
    if value:
        return AdminKey(value.strip(), ADMIN_KEY_ENV)
    if path:
        return _read_key_file(Path(path).expanduser(), source=f"{ADMIN_KEY_FILE_ENV}={path}")
    return None


def _read_key_file(path: Path, *, source: str) -> AdminKey:
    try:
        text = path.read_text()
        mode = path.stat().st_mode
    except OSError as exc:
        raise AdminKeyError(f"admin key file {path} ({source}) cannot be read: {exc.strerror or exc}") from exc
    if mode & stat.S_IROTH and not path.is_symlink():
        # Kubernetes mounts Secrets 0644 by default inside the pod; only warn.
        log.warning("admin key file %s is readable by every user on this machine; chmod 600 it", path)
    return AdminKey(text.strip(), str(path))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- TLS ---------------------------------------------------------------------------------------

# File names inside a TLS directory (`scorestack serve --tls-dir`, `scorestack dev-certs`).
CA_FILE, SERVER_CERT_FILE, SERVER_KEY_FILE, CLIENT_CERT_FILE, CLIENT_KEY_FILE = (
    "ca.crt",
    "server.crt",
    "server.key",
    "client.crt",
    "client.key",
)


def _need(path: Path, what: str) -> Path:
    if not path.is_file():
        raise TlsError(
            f"{what} {path} does not exist; put it there, or create throwaway local ones with "
            f"`scorestack dev-certs {path.parent}` (tests and demos only)"
        )
    return path


@dataclass(frozen=True)
class ServerTls:
    """Triton's gRPC TLS: its certificate and key, and with `mutual` the CA that client certificates must chain to."""

    cert: Path
    key: Path
    ca: Path | None = None
    mutual: bool = False

    def __post_init__(self) -> None:
        _need(self.cert, "server certificate")
        _need(self.key, "server private key")
        if self.mutual and self.ca is None:
            raise TlsError("mutual TLS needs the CA that signs client certificates (ca.crt)")
        if self.ca is not None:
            _need(self.ca, "CA certificate")

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], *, mutual: bool = False) -> "ServerTls":
        d = Path(directory)
        ca = d / CA_FILE
        return cls(d / SERVER_CERT_FILE, d / SERVER_KEY_FILE, ca if (mutual or ca.exists()) else None, mutual)

    def triton_args(self) -> list[str]:
        args = ["--grpc-use-ssl=true", f"--grpc-server-cert={self.cert}", f"--grpc-server-key={self.key}"]
        if self.ca is not None:
            args.append(f"--grpc-root-cert={self.ca}")
        if self.mutual:
            args.append("--grpc-use-ssl-mutual=true")
        return args


@dataclass(frozen=True)
class ClientTls:
    """What a client needs to reach a TLS Triton: the CA it trusts, and for mutual TLS its own certificate and key."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        _need(self.ca, "CA certificate")
        if (self.cert is None) != (self.key is None):
            raise TlsError("a client certificate needs its private key and the key its certificate: give both or neither")
        if self.cert is not None and self.key is not None:
            _need(self.cert, "client certificate")
            _need(self.key, "client private key")

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str], *, client_cert: bool = True) -> "ClientTls":
        d = Path(directory)
        cert, key = d / CLIENT_CERT_FILE, d / CLIENT_KEY_FILE
        if client_cert and cert.exists():
            return cls(d / CA_FILE, cert, key)
        return cls(d / CA_FILE)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "ClientTls | None":
        """The client TLS files of $SCORESTACK_TLS_DIR, or None (plaintext) when it is not set."""
        d = (os.environ if environ is None else environ).get(TLS_DIR_ENV)
        return cls.from_dir(Path(d).expanduser()) if d else None

    def grpc_kwargs(self) -> dict[str, object]:
        """Keyword arguments for tritonclient's gRPC clients (they take file paths)."""
        return {
            "ssl": True,
            "root_certificates": str(self.ca),
            "private_key": str(self.key) if self.key else None,
            "certificate_chain": str(self.cert) if self.cert else None,
        }


# --- telling a TLS mismatch from a server that is down -----------------------------------------

_EXPIRED = 10  # X509_V_ERR_CERT_HAS_EXPIRED
_NOT_YET_VALID = 9
# no issuer / bad signature (an issuer of the same name, another key) / self-signed / self-signed in
# chain / no local issuer / leaf unverifiable
_UNTRUSTED = (2, 7, 18, 19, 20, 21)
_HOSTNAME_MISMATCH = 62


def diagnose_tls(url: str, tls: ClientTls | None, timeout_s: float = 1.0) -> str | None:
    """Why a gRPC connection to `url` fails at the TLS layer, in words, or None when TLS is not the problem.

    Called after a connection failure (never on the request path): one TCP connection and one
    handshake, bounded by `timeout_s`. Tells apart a plaintext client against a TLS server (and the
    reverse), a server certificate from another CA, an expired one, one that does not name the host,
    and a server that wants a client certificate it did not get or refused. A server that is down
    or unreachable returns None: that is for the caller's retry logic.
    """
    import socket
    import ssl

    host, _, port = url.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError):
        return None  # not reachable at all: not a TLS question
    with raw:
        raw.settimeout(timeout_s)
        if tls is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            try:
                with ctx.wrap_socket(raw, server_hostname=host):
                    pass
            except ssl.SSLError as exc:
                # An alert is a TLS server speaking (e.g. a TLS 1.2 mutual-TLS server refusing a
                # handshake without a client certificate); anything else: it does not speak TLS.
                if "ALERT" not in str(getattr(exc, "reason", "") or exc).upper():
                    return None
            except OSError:
                return None  # it does not speak TLS either: the failure is elsewhere
            return (
                f"Triton at {url} requires TLS and this client connects in plaintext: give the client the CA "
                "(TritonClient(..., tls=ClientTls(ca=...)); with mutual TLS also its certificate and key)"
            )
        ctx = ssl.create_default_context(cafile=str(tls.ca))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # gRPC's server hangs up at once on a TLS connection that did not negotiate HTTP/2 (seen:
        # without ALPN "h2" every connection closes after the handshake, which reads like a refusal).
        ctx.set_alpn_protocols(["h2"])
        if tls.cert is not None and tls.key is not None:
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
        try:
            conn = ctx.wrap_socket(raw, server_hostname=host)
        except ssl.SSLCertVerificationError as exc:
            code = getattr(exc, "verify_code", None)
            if code == _EXPIRED:
                return f"the certificate Triton at {url} presented has expired ({exc.verify_message}): renew the server certificate"
            if code == _NOT_YET_VALID:
                return f"the certificate Triton at {url} presented is not valid yet: check the clocks and the certificate"
            if code in _UNTRUSTED:
                return f"the certificate Triton at {url} presented is not signed by the CA this client trusts ({tls.ca}): wrong CA, or a server impersonating Triton ({exc.verify_message})"
            if code == _HOSTNAME_MISMATCH:
                return f"the certificate Triton at {url} presented does not name {host!r}: connect by a name in its subjectAltName or reissue it"
            return f"the certificate Triton at {url} presented was refused: {exc.verify_message}"
        except ssl.SSLError as exc:
            return _alert(url, tls, exc) or f"Triton at {url} does not speak TLS (TLS handshake failed: {exc.reason or exc}): the server runs in plaintext; start it with TLS or connect without tls"
        except OSError as exc:
            # The peer hung up on our ClientHello: a plaintext HTTP/2 server does exactly that.
            return f"Triton at {url} does not speak TLS (it closed the connection during the TLS handshake: {exc}): the server runs in plaintext; start it with TLS or connect without tls"
        with conn:
            # TLS 1.3 servers check the client certificate after the handshake: their refusal arrives
            # on the first read (an alert, or gRPC simply hanging up). A server that accepted us
            # sends its HTTP/2 SETTINGS frame unprompted.
            try:
                conn.settimeout(min(timeout_s, 0.5))
                data = conn.recv(64)
            except ssl.SSLError as exc:
                return _alert(url, tls, exc) or _refused_client(url, tls)
            except TimeoutError:
                return None  # connected, nothing refused: TLS is fine
            except OSError:
                return _refused_client(url, tls)  # reset right after the handshake
            if not data:
                # gRPC's server hangs up without an alert when it rejects the client certificate.
                return _refused_client(url, tls)
    return None


def _refused_client(url: str, tls: ClientTls) -> str:
    """The server completed the handshake, then hung up: the client certificate (or its absence) was refused."""
    if tls.cert is None:
        return f"Triton at {url} requires a client certificate (mutual TLS) and this client sent none: give ClientTls a cert and key signed by the server's client CA"
    expired = _expired(tls.cert)
    if expired:
        return f"Triton at {url} refused this client's certificate {tls.cert}: it expired on {expired}; renew it"
    return f"Triton at {url} refused this client's certificate {tls.cert}: it is not signed by the CA the server trusts for clients"


def _expired(cert: Path) -> str | None:
    import datetime as dt

    from cryptography import x509

    try:
        c = x509.load_pem_x509_certificate(cert.read_bytes())
    except (OSError, ValueError):
        return None
    end = c.not_valid_after_utc
    return end.isoformat() if end < dt.datetime.now(dt.timezone.utc) else None


def _alert(url: str, tls: ClientTls, exc: Exception) -> str | None:
    reason = (getattr(exc, "reason", None) or str(exc)).upper()
    if "CERTIFICATE_REQUIRED" in reason or ("HANDSHAKE_FAILURE" in reason and tls.cert is None):
        return f"Triton at {url} requires a client certificate (mutual TLS) and this client sent none: give ClientTls a cert and key signed by the server's client CA"
    if "CERTIFICATE_EXPIRED" in reason:
        return f"Triton at {url} refused this client's certificate {tls.cert}: it has expired; renew it"
    if any(s in reason for s in ("UNKNOWN_CA", "BAD_CERTIFICATE", "DECRYPT_ERROR", "ACCESS_DENIED")):
        return f"Triton at {url} refused this client's certificate {tls.cert}: not signed by the CA it trusts for clients ({reason.lower()})"
    return None


# --- the key without a command line: handing it to tritonserver through a pipe ----------------------

# Triton 2.51 takes the restricted-API key only as a command-line value, and every user who can list
# processes reads command lines (/proc/<pid>/cmdline is world-readable). So tritonserver is started
# with a random placeholder where the key goes, the key is written into a pipe whose read end it
# inherits, and a tiny library preloaded into it (LD_PRELOAD) reads the pipe in its constructor --
# before tritonserver's main() parses its options -- and points main's argv entries at heap copies
# with the key in place of the placeholder. The process's command line (the strings the kernel
# shows) holds only the placeholder; its environment holds only the fd number and the library path.
# If the library did not load, Triton would be restricted to the placeholder, which nobody sends:
# the caller's first admin call with the real key is refused and the start fails (LocalTriton checks
# the repository index with the key before it reports ready).
KEY_FD_ENV = "SCORESTACK_ADMIN_KEY_FD"
KEY_PLACEHOLDER_ENV = "SCORESTACK_ADMIN_KEY_PLACEHOLDER"
_SHIM_NAME = "scorestack_keyshim.so"
# The library's C source: serve/keyshim.c (package data; the Triton image builds the same file,
# deploy/triton/Dockerfile). Its sha256 tags the built library, so an edited source is rebuilt.
_SHIM_SOURCE_FILE = "keyshim.c"


def key_shim_source() -> str:
    """The C source of the key-handoff library (serve/keyshim.c)."""
    from importlib import resources

    return (resources.files("scorestack.serve") / _SHIM_SOURCE_FILE).read_text(encoding="utf-8")


def build_key_shim(directory: str | os.PathLike[str]) -> Path:
    """Compile the key-handoff library into `directory` (a private one: it is preloaded into tritonserver).

    Needs a C compiler (gcc, as TL2cgen does); raises AdminKeyError naming it when there is none.
    """
    import hashlib

    from scorestack.serve.cbuild import build_library

    source = key_shim_source()
    tag = hashlib.sha256(source.encode()).hexdigest()[:12]
    return build_library(source, Path(directory) / f"{tag}-{_SHIM_NAME}", error=AdminKeyError,
                         what="handing the admin key to tritonserver without its command line")


@dataclass
class KeyHandoff:
    """How to start tritonserver restricted by `key` without the key in its command line or environment.

    Start it with `args`, the environment updated with `env`, and `pass_fds=(read_fd,)`; then call
    `close()` in the parent (the child keeps its copy of the pipe, already holding the key).
    """

    args: list[str]
    env: dict[str, str]
    read_fd: int

    def close(self) -> None:
        try:
            os.close(self.read_fd)
        except OSError:
            pass


def key_handoff(args: list[str], key: AdminKey, shim: Path, *, ld_preload: str | None = None) -> KeyHandoff:
    """Replace `key` in tritonserver's `args` (e.g. from `AdminKey.triton_args`) with a random
    placeholder, and write the key into a pipe for the preloaded `shim` (`build_key_shim`) to read."""
    import secrets

    placeholder = f"scorestack-key-placeholder-{secrets.token_hex(16)}"
    if not any(key.value in a for a in args):
        raise AdminKeyError("no tritonserver argument carries the admin key: nothing to hand over")
    new_args = [a.replace(key.value, placeholder) for a in args]
    read_fd, write_fd = os.pipe()
    try:
        data = key.value.encode()
        if os.write(write_fd, data) != len(data):  # a pipe holds 64 KiB; a key is < 1 KiB
            raise AdminKeyError("could not write the admin key into its pipe")
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    preload = f"{shim}:{ld_preload}" if ld_preload else str(shim)
    env = {"LD_PRELOAD": preload, KEY_FD_ENV: str(read_fd), KEY_PLACEHOLDER_ENV: placeholder}
    return KeyHandoff(new_args, env, read_fd)
