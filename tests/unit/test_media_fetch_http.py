"""``encoder.media_fetch`` over real HTTP(S): fetches from the local server of ``tests/media_servers.py``.

What a fetch that reaches a server does under a MediaPolicy: the allowlist and
address checks on a live URL, the connection pinned to the checked address,
redirects, error statuses, size and time limits, and TLS checked against the URL's
host. The servers listen on 127.0.0.1 only; every other address in here is refused
before any connection is made, which is what the tests check.
"""

from __future__ import annotations

import ssl
import time

import pytest
from media_servers import LIMIT, PNG, TEST_CERT, TEST_KEY, fake_dns, remote, serve, url

from encoder.media_fetch import MediaPolicy, load_url
from encoder.media import MediaError


@pytest.fixture(scope="module")
def server():
    server = serve()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    (folder / "cert.pem").write_text(TEST_CERT)
    (folder / "key.pem").write_text(TEST_KEY)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    server = serve(context)
    server.cafile = str(folder / "cert.pem")
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def trust_test_cert(monkeypatch, tls_server):
    """The client's default context, trusting the test certificate as well."""
    original = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *args, **kwargs: original(cafile=tls_server.cafile))


# ---- success, allowlist, addresses -------------------------------------------------------


def test_fetch_returns_the_exact_bytes_and_sends_the_url_host(server):
    assert load_url(url(server, "/img.png"), remote()) == PNG
    assert server.seen[-1] == ("/img.png", f"localhost:{server.server_address[1]}")


def test_remote_fetching_is_off_by_default(server):
    before = len(server.seen)
    with pytest.raises(MediaError, match="remote media fetching is off; set allowed_media_domains"):
        load_url(url(server, "/img.png"), MediaPolicy())
    assert len(server.seen) == before


def test_host_not_in_the_allowlist_is_refused(server):
    policy = remote(allowed_media_domains=("example.com", "*.localhost"))  # the wildcard does not cover the apex
    with pytest.raises(MediaError, match="'localhost' is not in allowed_media_domains"):
        load_url(url(server, "/img.png"), policy)


def test_loopback_is_refused_without_allowed_private_networks(server):
    with pytest.raises(MediaError, match="resolves to 127.0.0.1, not public; allow it in allowed_private_networks"):
        load_url(url(server, "/img.png"), MediaPolicy(allowed_media_domains=("localhost",)))


def test_host_is_resolved_once_and_the_connection_pinned(server, monkeypatch):
    """A wildcard-allowed name the system resolver does not know: only the checked answer is used."""
    lookups = fake_dns(monkeypatch, {"img.cdn.test": ["127.0.0.1"]})
    assert load_url(url(server, "/img.png", host="img.cdn.test"), remote(allowed_media_domains=("*.cdn.test",))) == PNG
    assert lookups == ["img.cdn.test"]
    assert server.seen[-1] == ("/img.png", f"img.cdn.test:{server.server_address[1]}")


def test_userinfo_is_refused(server):
    before = len(server.seen)
    for target in (url(server, "/img.png", host="user:pw@localhost"), url(server, "/img.png", host="user@localhost")):
        with pytest.raises(MediaError, match="credentials"):
            load_url(target, remote())
    assert len(server.seen) == before


# ---- redirects, status, size, time -------------------------------------------------------


def test_redirect_is_refused_by_default(server):
    with pytest.raises(MediaError, match="set allow_redirects"):
        load_url(url(server, "/redirect-ok"), remote())


def test_redirect_is_followed_when_allowed(server):
    assert load_url(url(server, "/redirect-ok"), remote(allow_redirects=True)) == PNG
    assert [path for path, _ in server.seen[-2:]] == ["/redirect-ok", "/img.png"]


def test_redirect_loop_stops_at_max_redirects(server):
    before = len(server.seen)
    with pytest.raises(MediaError, match="more than max_redirects=3 redirects"):
        load_url(url(server, "/redirect-loop"), remote(allow_redirects=True, max_redirects=3))
    assert [path for path, _ in server.seen[before:]] == ["/redirect-loop"] * 4
    with pytest.raises(MediaError, match="max_redirects=0"):
        load_url(url(server, "/redirect-ok"), remote(allow_redirects=True, max_redirects=0))


def test_redirect_to_a_private_address_is_refused(server):
    policy = remote(allow_redirects=True, allowed_media_domains=("localhost", "10.0.0.1"))
    with pytest.raises(MediaError, match="resolves to 10.0.0.1, not public"):
        load_url(url(server, "/redirect-private"), policy)


def test_redirect_to_another_domain_is_refused(server):
    with pytest.raises(MediaError, match="'evil.example' is not in allowed_media_domains"):
        load_url(url(server, "/redirect-other-domain"), remote(allow_redirects=True))


def test_redirect_to_a_file_url_is_refused(server):
    with pytest.raises(MediaError, match="only http:// and https://"):
        load_url(url(server, "/redirect-file"), remote(allow_redirects=True, allowed_local_media_path="/"))


def test_error_status_is_refused(server):
    with pytest.raises(MediaError, match="answered HTTP 404"):
        load_url(url(server, "/404"), remote())


def test_max_bytes_is_inclusive(server):
    assert load_url(url(server, "/img.png"), remote(max_item_bytes=len(PNG))) == PNG
    with pytest.raises(MediaError, match="Content-Length"):
        load_url(url(server, "/img.png"), remote(max_item_bytes=len(PNG) - 1))


def test_content_length_over_the_limit_is_refused_unread(server):
    started = time.monotonic()
    with pytest.raises(MediaError, match=f"10000000000 bytes \\(Content-Length\\); the limit is max_item_bytes={LIMIT}"):
        load_url(url(server, "/big"), remote(max_item_bytes=LIMIT))
    assert time.monotonic() - started < 1


@pytest.mark.parametrize("path", ["/chunked-big", "/stream-big"])
def test_streamed_body_over_the_limit_is_cut(server, path):
    with pytest.raises(MediaError, match=f"larger than max_item_bytes={LIMIT}; stopped reading"):
        load_url(url(server, path), remote(max_item_bytes=LIMIT))


def test_truncated_body_is_refused(server):
    with pytest.raises(MediaError, match="after 10 of 1000 bytes"):
        load_url(url(server, "/truncated"), remote())


@pytest.mark.parametrize("path", ["/slow", "/slow-headers"])
def test_trickling_server_is_cut_at_the_deadline(server, path):
    started = time.monotonic()
    with pytest.raises(MediaError, match="took longer than fetch_timeout_s=1"):
        load_url(url(server, path), remote(fetch_timeout_s=1))
    assert time.monotonic() - started < 3


# ---- TLS ---------------------------------------------------------------------------------


def test_https_checks_the_certificate_against_the_url_host(tls_server, trust_test_cert):
    # The connection goes to the pinned 127.0.0.1, which the certificate does not name:
    # this passes only if SNI and the hostname check use "localhost".
    assert load_url(url(tls_server, "/img.png", scheme="https"), remote()) == PNG


def test_https_refuses_a_certificate_for_another_name(tls_server, trust_test_cert):
    policy = remote(allowed_media_domains=("127.0.0.1",))
    with pytest.raises(MediaError, match="certificate"):
        load_url(url(tls_server, "/img.png", host="127.0.0.1", scheme="https"), policy)


def test_https_refuses_an_untrusted_certificate(tls_server):
    with pytest.raises(MediaError, match="CERTIFICATE_VERIFY_FAILED"):
        load_url(url(tls_server, "/img.png", scheme="https"), remote())
