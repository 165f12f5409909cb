"""The online store over TLS: a private redis-server that speaks only TLS and requires a client
certificate; `rediss://` URLs with a CA file and client certificate, through Feast and every reader."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from scorestack.errors import FeatureError, ServerError
from scorestack.features import store
from scorestack.demo import features as demo_features
from scorestack.features.fetch import FeatureFetcher, FeatureStatus
from scorestack.serve.devcerts import DevCerts, write_dev_certs
from scorestack.serve.readiness import port_open, process_exit, wait_until
from scorestack.serve.ports import free_port


@pytest.fixture
def tls_redis(tmp_path):
    """A redis-server listening only on TLS, requiring client certificates; yields (port, certificates)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("required service missing: redis-server binary not found (apt-get install redis-server)")
    certs = write_dev_certs(tmp_path / "certs")  # throwaway CA; server certificate for 127.0.0.1 and localhost
    port = free_port()
    proc = subprocess.Popen(
        [
            binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
            "--tls-cert-file", str(certs.server_cert), "--tls-key-file", str(certs.server_key),
            "--tls-ca-cert-file", str(certs.ca), "--tls-auth-clients", "yes",
            "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        try:
            wait_until(lambda: port_open("127.0.0.1", port), timeout_s=10, what="redis-server with TLS", died=process_exit(proc))
        except ServerError as exc:
            pytest.fail(f"{exc}: {proc.stdout.read().decode()[-500:] if proc.poll() is not None else ''}")
        yield port, certs
    finally:
        proc.terminate()
        proc.wait(10)


def _url(port: int, certs: DevCerts, *, client: bool = True, ca: bool = True) -> str:
    query = []
    if ca:
        query.append(f"ssl_ca_certs={certs.ca}")
    if client:
        query += [f"ssl_certfile={certs.client_cert}", f"ssl_keyfile={certs.client_key}"]
    return f"rediss://127.0.0.1:{port}/0" + ("?" + "&".join(query) if query else "")


async def test_tls_store_through_feast_and_every_reader(tls_redis, tmp_path):
    port, certs = tls_redis
    repo = demo_features.init_repo(tmp_path / "repo", online="redis", redis_url=_url(port, certs), n_users=40, n_items=30, project="t_tls")
    assert "ssl=true" in (repo / "feature_store.yaml").read_text()
    store.apply(repo)
    store.materialize(repo)  # Feast's own writes go over TLS with the client certificate
    fs = store.feature_store(repo)
    rows = [{"user_id": u} for u in (1, 2, 3, 999_999)]
    want = fs.get_online_features(features=fs.get_feature_service("fraud"), entity_rows=rows).to_dict()
    for backend in ("direct", "feast_async", "feast_sync"):
        async with FeatureFetcher(fs, backend=backend, timeout_s=5.0) as fetcher:
            result = await fetcher.fetch("fraud", rows)
            if backend == "direct":
                # TLS files are not the lean connection's (features/resp.py): the reader keeps redis-py and says why.
                assert "ssl_ca_certs" in (fetcher._lanes["direct"].backend.lean_reason or "")
        assert not result.degraded, (backend, result.reason)
        for j, name in enumerate(result.feature_names):
            np.testing.assert_array_equal(result.values[:3, j], np.float32(want[name][:3]), err_msg=f"{backend} {name}")
        assert (result.status[:3] == FeatureStatus.PRESENT).all() and (result.status[3] == FeatureStatus.MISSING).all()


async def test_tls_without_the_right_ca_or_client_certificate_degrades(tls_redis, tmp_path):
    """A client that does not trust the server, or brings no certificate, never reads: defaults, and says why."""
    port, certs = tls_redis
    good = demo_features.init_repo(tmp_path / "good", online="redis", redis_url=_url(port, certs), n_users=10, n_items=5, project="t_tls_bad")
    store.apply(good)
    store.materialize(good)
    for name, url in (("no_ca", _url(port, certs, ca=False)), ("no_client_cert", _url(port, certs, client=False))):
        repo = demo_features.init_repo(tmp_path / name, online="redis", redis_url=url, n_users=10, n_items=5, project="t_tls_bad")
        store.apply(repo)
        async with FeatureFetcher(store.feature_store(repo), backend="direct", timeout_s=2.0) as fetcher:
            result = await fetcher.fetch("fraud", {"user_id": 1})
        assert result.degraded and (result.status == FeatureStatus.DEFAULTED).all(), name
        assert result.reason.startswith("error:"), (name, result.reason)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis://127.0.0.1:6379/0?ssl_ca_certs=/etc/hosts", "need a rediss:// URL"),
        ("rediss://127.0.0.1:6379/0?ssl_ca_certs=/no/such/ca.pem", "does not exist"),
        ("rediss://127.0.0.1:6379/0?ssl_certfile=/etc/hosts", "both ssl_certfile and ssl_keyfile"),
        ("rediss://127.0.0.1:6379/0?ssl_cert_reqs=maybe", "ssl_cert_reqs"),
        ("rediss://127.0.0.1:6379/0?tls=yes", "unknown option"),
    ],
)
def test_bad_tls_options_name_the_option(url, match):
    with pytest.raises(FeatureError, match=match):
        store.redis_connection_string(url)


def test_tls_options_reach_feasts_connection_string(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-")
    conn = store.redis_connection_string(f"rediss://:secret@cache.example:6380/2?ssl_ca_certs={ca}&ssl_check_hostname=True")
    assert conn.startswith("cache.example:6380,db=2,password=secret,ssl=true,")
    assert f"ssl_ca_certs={ca}" in conn and "ssl_check_hostname=true" in conn
