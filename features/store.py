"""The working Feast feature repository: write it, apply it, materialize it, open it.

The installed package may be read-only, so the repository lives in a directory the user picks
(default `<workspace>/feature_repo`): the definitions module is copied there beside a rendered
`feature_store.yaml` and a `data/` folder for the parquet tables its sources read
(`source_path`), and Feast's own CLI (`feast apply`, `feast materialize`) works on it unchanged.
Whoever owns the data writes the tables (the demo's: `scorestack.demo.features`).
"""

from __future__ import annotations

import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Literal
from urllib.parse import parse_qs, unquote, urlparse

from scorestack import paths
from scorestack.errors import FeatureError

if TYPE_CHECKING:
    import feast

PROJECT = "scorestack"
DEFINITIONS = Path(__file__).resolve().parent / "repo" / "definitions.py"

# Bounds on every Redis call Feast makes (docs/platform-notes.md: with redis-py's default retries a read
# against a stopped Redis blocked 6.7-9.8 s). The request path adds its own, tighter budget.
REDIS_SOCKET_TIMEOUT_S = 1.0
REDIS_CONNECT_TIMEOUT_S = 0.5

Online = Literal["sqlite", "redis"]


def default_repo_dir() -> Path:
    """`<workspace>/feature_repo`, where `scorestack features apply` writes by default."""
    return paths.workspace() / "feature_repo"


# TLS options of a rediss:// URL (query parameters), passed to redis-py by Feast and the direct reader.
TLS_FILE_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
TLS_OPTIONS = (*TLS_FILE_OPTIONS, "ssl_cert_reqs", "ssl_check_hostname")


def redis_connection_string(
    redis_url: str,
    socket_timeout_s: float = REDIS_SOCKET_TIMEOUT_S,
    socket_connect_timeout_s: float = REDIS_CONNECT_TIMEOUT_S,
) -> str:
    """Feast's `host:port,db=N,...` form of a `redis[s]://[user:password@]host:port/db[?tls options]` URL, retries off.

    `rediss://` turns TLS on; its query may name `ssl_ca_certs` (the CA file that signed the
    server's certificate), `ssl_certfile` + `ssl_keyfile` (a client certificate, for servers that
    require one), `ssl_cert_reqs` (required, optional or none) and `ssl_check_hostname`.
    """
    url = urlparse(redis_url)
    if url.scheme not in ("redis", "rediss") or not url.hostname:
        raise FeatureError(f"redis_url: expected redis://host:port/db or rediss://host:port/db, got {redis_url!r}")
    db = url.path.lstrip("/") or "0"
    if not db.isdigit():
        raise FeatureError(f"redis_url: database must be a number, got {db!r} in {redis_url!r}")
    parts = [f"{url.hostname}:{url.port or 6379}", f"db={db}"]
    if url.password:
        parts.append(f"password={unquote(url.password)}")
    if url.username:
        parts.append(f"username={unquote(url.username)}")
    options = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
    unknown = sorted(set(options) - set(TLS_OPTIONS))
    if unknown:
        raise FeatureError(f"redis_url: unknown option(s) {unknown}; supported: {', '.join(TLS_OPTIONS)}")
    if options and url.scheme != "rediss":
        raise FeatureError(f"redis_url: TLS options {sorted(options)} need a rediss:// URL")
    if url.scheme == "rediss":
        parts.append("ssl=true")
        for name, value in options.items():
            if "," in value or "=" in value:
                raise FeatureError(f"redis_url: {name}={value!r} may not contain ',' or '=' (Feast's connection string separators)")
            if name in TLS_FILE_OPTIONS:
                path = Path(value).expanduser().resolve()
                if not path.is_file():
                    raise FeatureError(f"redis_url: {name} file {path} does not exist")
                value = str(path)
            elif name == "ssl_cert_reqs" and value not in ("required", "optional", "none"):
                raise FeatureError(f"redis_url: ssl_cert_reqs must be required, optional or none, got {value!r}")
            elif name == "ssl_check_hostname":
                if value.lower() not in ("true", "false"):
                    raise FeatureError(f"redis_url: ssl_check_hostname must be true or false, got {value!r}")
                value = value.lower()
            parts.append(f"{name}={value}")
        if ("ssl_certfile" in options) != ("ssl_keyfile" in options):
            raise FeatureError("redis_url: a client certificate needs both ssl_certfile and ssl_keyfile")
    # retry=null: Feast json-decodes it to None, which redis-py turns into "no retries".
    parts += [f"socket_timeout={socket_timeout_s}", f"socket_connect_timeout={socket_connect_timeout_s}", "retry=null"]
    return ",".join(parts)


def render_feature_store_yaml(
    online: Online = "sqlite", redis_url: str | None = None, project: str = PROJECT
) -> str:
    """The `feature_store.yaml` of a working repository (paths relative to the repository)."""
    if online == "sqlite":
        online_store = "online_store:\n  type: sqlite\n  path: data/online.db\n"
    elif online == "redis":
        conn = redis_connection_string(redis_url or "redis://127.0.0.1:6379/0")
        online_store = f'online_store:\n  type: redis\n  connection_string: "{conn}"\n'
    else:
        raise FeatureError(f"online: expected 'sqlite' or 'redis', got {online!r}")
    if not project.isidentifier():
        raise FeatureError(f"project: must be letters, digits and underscores, got {project!r}")
    return (
        f"project: {project}\n"
        "provider: local\n"
        "registry: data/registry.db\n"
        f"{online_store}"
        "offline_store:\n  type: file\n"
        "entity_key_serialization_version: 3\n"
    )


# The parquet tables the definitions' sources read, one row per entity with an `event_timestamp`.
SOURCE_FILES = {"user": "users.parquet", "item": "items.parquet"}


def source_path(repo_dir: str | Path, entity: str) -> Path:
    """Where the table of `entity` (user, item) lies in a working repository: `data/<file>`."""
    if entity not in SOURCE_FILES:
        raise FeatureError(f"entity: expected one of {sorted(SOURCE_FILES)}, got {entity!r}")
    return Path(repo_dir) / "data" / SOURCE_FILES[entity]


def write_repo(
    repo_dir: str | Path | None = None,
    online: Online = "sqlite",
    redis_url: str | None = None,
    *,
    project: str = PROJECT,
) -> Path:
    """Write a working feature repository: the definitions, feature_store.yaml and an empty `data/`.

    Returns the repository directory. Put the source tables at `source_path(repo, entity)`, then
    run `apply` and `materialize` (or `feast apply` and `feast materialize` inside it).
    """
    repo = Path(repo_dir) if repo_dir is not None else default_repo_dir()
    yaml_text = render_feature_store_yaml(online, redis_url, project)
    (repo / "data").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DEFINITIONS, repo / "definitions.py")
    (repo / "feature_store.yaml").write_text(yaml_text)
    (repo / ".feastignore").write_text("data/\n")
    return repo


def _check_repo(repo_dir: str | Path) -> Path:
    repo = Path(repo_dir)
    if not (repo / "feature_store.yaml").is_file():
        raise FeatureError(
            f"repo_dir: no feature_store.yaml in {repo}; create it with `scorestack features apply --repo-dir {repo}`"
        )
    return repo


def feature_store(repo_dir: str | Path | None = None) -> "feast.FeatureStore":
    """A `feast.FeatureStore` on a working repository."""
    import feast

    return feast.FeatureStore(repo_path=str(_check_repo(repo_dir if repo_dir is not None else default_repo_dir())))


def apply(repo_dir: str | Path | None = None) -> "feast.FeatureStore":
    """Register the repository's entities, views and services (what `feast apply` does)."""
    store = feature_store(repo_dir)
    # Load the copy in the working repository, as `feast apply` does, so its FileSource paths point
    # at this repository's data/.
    store.apply(_load_repo_objects(Path(store.repo_path)))
    return store


def _load_repo_objects(repo: Path) -> list:
    import importlib.util

    from feast import Entity, FeatureService, FeatureView, OnDemandFeatureView
    from feast.data_source import DataSource

    spec = importlib.util.spec_from_file_location(f"_scorestack_feature_repo_{abs(hash(str(repo)))}", repo / "definitions.py")
    if spec is None or spec.loader is None:
        raise FeatureError(f"repo_dir: cannot load {repo / 'definitions.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kinds = (Entity, DataSource, FeatureView, OnDemandFeatureView, FeatureService)
    return [v for v in vars(module).values() if isinstance(v, kinds)]


def materialize(repo_dir: str | Path | None = None, end: datetime | None = None) -> "feast.FeatureStore":
    """Load every row up to `end` (default: now) from the parquet sources into the online store."""
    store = feature_store(repo_dir)
    end = end or datetime.now(timezone.utc) + timedelta(seconds=1)
    store.materialize(start_date=datetime(2000, 1, 1, tzinfo=timezone.utc), end_date=end)
    return store
