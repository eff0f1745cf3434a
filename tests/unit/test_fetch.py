"""``encoder.media_fetch``: the media policy, against a real local HTTP(S) server and real files.

The servers listen on 127.0.0.1 only; tests that want a fetch to succeed name it
``localhost`` and allow the loopback networks explicitly, as a deployment would.
Nothing leaves the machine: every other address in here is refused before any
connection is made, which is what the tests check.
"""

from __future__ import annotations

import http.server
import os
import socket
import ssl
import threading
import time

import pytest
from support import image_bytes

from encoder.media_fetch import MediaPolicy, address_allowed, host_allowed, load_url
from encoder.media import MediaError

PNG = image_bytes(32, 24, seed=3)
LOOPBACK = ("127.0.0.1/32", "::1/128")
LIMIT = 64 * 1024  # max_item_bytes of the size tests
STREAM_CAP = 64 * 1024 * 1024  # what the streaming endpoints send to a client that never stops reading

# A self-signed certificate for DNS name "localhost" only (no IP address), valid 2000-2999.
# Test-only key: it protects nothing.
TEST_CERT = """-----BEGIN CERTIFICATE-----
MIIBvDCCAWKgAwIBAgIUAKRai9mmon4N2gVp/1Urx/RykiowCgYIKoZIzj0EAwIw
FDESMBAGA1UEAwwJbG9jYWxob3N0MCAXDTAwMDEwMTAwMDAwMFoYDzI5OTkxMjMx
MDAwMDAwWjAUMRIwEAYDVQQDDAlsb2NhbGhvc3QwWTATBgcqhkjOPQIBBggqhkjO
PQMBBwNCAATtlwMhzj4gCXuQ2EcwZL83I+MiictVgI213I6gnAdQNv3bMOTu+2A5
GeKWbgE1sx/VpoJgHiTckmGahTru8d7xo4GPMIGMMBQGA1UdEQQNMAuCCWxvY2Fs
aG9zdDAPBgNVHRMBAf8EBTADAQH/MA4GA1UdDwEB/wQEAwIChDATBgNVHSUEDDAK
BggrBgEFBQcDATAdBgNVHQ4EFgQUpCWo/BQGYdfxBnetEqvFWItEOnswHwYDVR0j
BBgwFoAUpCWo/BQGYdfxBnetEqvFWItEOnswCgYIKoZIzj0EAwIDSAAwRQIgGF9K
xFz56SrzX80HSfkU7JacGYwOYAfTSL+SUEqFK0UCIQCgwwNKzeXwoe5rZm677DXQ
siQr0FRZyUAd4WfJqyV8tA==
-----END CERTIFICATE-----
"""
TEST_KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgKgFOtg9YwmYKKL7r
RL9nGwN+ec2xz4kChoxJSU6GQwmhRANCAATtlwMhzj4gCXuQ2EcwZL83I+MiictV
gI213I6gnAdQNv3bMOTu+2A5GeKWbgE1sx/VpoJgHiTckmGahTru8d7x
-----END PRIVATE KEY-----
"""


# ---- the local server -------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self.server.seen.append((self.path, self.headers.get("Host")))
        self.close_connection = True
        route = _ROUTES.get(self.path)
        try:
            if route is None:
                self._reply(404, b"not here")
            else:
                route(self)
        except OSError:
            pass  # the client stopped reading: what the size and time limits are for

    def _reply(self, status, body=b"", **headers):
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _head(self, **headers):
        self.send_response(200)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.send_header("Connection", "close")
        self.end_headers()

    def big(self):
        self._head(Content_Length=str(10**10))
        self.wfile.write(b"x" * 1000)

    def chunked_big(self):
        self._head(Transfer_Encoding="chunked")
        chunk = b"x" * 16384
        for _ in range(STREAM_CAP // len(chunk)):
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")

    def stream_big(self):  # neither Content-Length nor chunked: the body ends when the connection does
        self._head()
        for _ in range(STREAM_CAP // 16384):
            self.wfile.write(b"x" * 16384)

    def truncated(self):
        self._head(Content_Length="1000")
        self.wfile.write(b"x" * 10)

    def slow(self):
        self._head(Content_Length="50")
        for _ in range(50):  # 10 s in all, unless the client hangs up
            self.wfile.write(b"x")
            time.sleep(0.2)

    def slow_headers(self):
        self.wfile.write(b"HTTP/1.1 200 OK\r\n")
        for byte in b"X-Slow: " + b"a" * 50:
            self.wfile.write(bytes([byte]))
            time.sleep(0.2)


def _redirect(location):
    return lambda handler: handler._reply(302, Location=location)


_ROUTES = {
    "/img.png": lambda handler: handler._reply(200, PNG, Content_Type="image/png"),
    "/big": _Handler.big,
    "/chunked-big": _Handler.chunked_big,
    "/stream-big": _Handler.stream_big,
    "/truncated": _Handler.truncated,
    "/slow": _Handler.slow,
    "/slow-headers": _Handler.slow_headers,
    "/redirect-ok": _redirect("/img.png"),  # relative, resolved against the current URL
    "/redirect-loop": _redirect("/redirect-loop"),
    "/redirect-private": _redirect("http://10.0.0.1/x"),
    "/redirect-other-domain": _redirect("http://evil.example/x"),
    "/redirect-file": _redirect("file:///etc/passwd"),
}


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # clients that hang up early (or fail the TLS handshake) are what several tests do


def _serve(tls_context=None):
    server = _Server(("127.0.0.1", 0), _Handler)
    server.seen = []
    if tls_context is not None:
        server.socket = tls_context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture(scope="module")
def server():
    server = _serve()
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
    server = _serve(context)
    server.cafile = str(folder / "cert.pem")
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def trust_test_cert(monkeypatch, tls_server):
    """The client's default context, trusting the test certificate as well."""
    original = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *args, **kwargs: original(cafile=tls_server.cafile))


def url(server, path, host="localhost", scheme="http"):
    return f"{scheme}://{host}:{server.server_address[1]}{path}"


def remote(**overrides):
    """A policy that may fetch from the local server."""
    settings = {"allowed_media_domains": ("localhost",), "allowed_private_networks": LOOPBACK, "fetch_timeout_s": 5}
    return MediaPolicy(**{**settings, **overrides})


def fake_dns(monkeypatch, answers):
    """Resolve the names in ``answers`` to the given addresses; record every lookup."""
    lookups = []
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, **kwargs):
        lookups.append(host)
        if host not in answers:
            return real(host, port, *args, **kwargs)
        return [
            (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (ip, port, 0, 0)) if ":" in ip
            else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port))
            for ip in answers[host]
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return lookups


# ---- remote: success, allowlist, addresses ----------------------------------------------


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


@pytest.mark.parametrize(
    "host, entries, allowed",
    [
        ("example.com", ["example.com"], True),
        ("EXAMPLE.com.", ["example.com"], True),
        ("example.com", ["Example.COM."], True),
        ("a.example.com", ["example.com"], False),
        ("example.com.evil.test", ["example.com"], False),
        ("a.example.com", ["*.example.com"], True),
        ("a.b.example.com", ["*.example.com"], True),
        ("example.com", ["*.example.com"], False),
        ("badexample.com", ["*.example.com"], False),
        (".example.com", ["*.example.com"], False),
        ("1.2.3.4", ["1.2.3.4"], True),
        ("1.2.3.4", ["1.2.3.5"], False),
        ("1.2.3.4", ["*.2.3.4"], False),
        ("::1", ["[0::1]"], True),
        ("127.0.0.1", ["localhost"], False),
        ("localhost", ["127.0.0.1"], False),
        ("example.com", [], False),
    ],
)
def test_host_matching(host, entries, allowed):
    assert host_allowed(host, entries) is allowed


NON_PUBLIC = [
    "169.254.169.254", "10.0.0.1", "10.255.255.255", "192.168.1.1", "172.16.0.1", "172.31.255.255",
    "100.64.0.1", "100.127.255.254", "127.0.0.1", "::1", "fe80::1", "::ffff:127.0.0.1",
    "::ffff:169.254.169.254", "224.0.0.1", "ff02::1", "0.0.0.0", "::", "fc00::1", "fec0::1",
    "240.0.0.1", "255.255.255.255", "2002:7f00:1::", "64:ff9b::a9fe:a9fe",
]


@pytest.mark.parametrize("address", NON_PUBLIC)
def test_non_public_addresses_are_refused(address):
    assert address_allowed(address) is False


@pytest.mark.parametrize("address", ["8.8.8.8", "93.184.216.34", "172.32.0.1", "100.128.0.1", "2606:4700:4700::1111"])
def test_public_addresses_are_allowed(address):
    assert address_allowed(address) is True


def test_allowed_private_networks_open_exactly_their_addresses():
    assert address_allowed("127.0.0.1", ["127.0.0.1/32"])
    assert address_allowed("::ffff:127.0.0.1", ["127.0.0.1/32"])
    assert address_allowed("10.1.2.3", ["10.0.0.0/8"])
    assert not address_allowed("127.0.0.2", ["127.0.0.1/32"])
    assert not address_allowed("169.254.169.254", ["10.0.0.0/8"])


def test_loopback_is_refused_without_allowed_private_networks(server):
    with pytest.raises(MediaError, match="resolves to 127.0.0.1, not public; allow it in allowed_private_networks"):
        load_url(url(server, "/img.png"), MediaPolicy(allowed_media_domains=("localhost",)))


@pytest.mark.parametrize(
    "host, target",
    [
        ("169.254.169.254", "http://169.254.169.254/latest/meta-data/"),
        ("10.0.0.1", "http://10.0.0.1/x"),
        ("::1", "http://[::1]:8080/x"),
        ("::ffff:127.0.0.1", "http://[::ffff:127.0.0.1]/x"),
        ("0.0.0.0", "https://0.0.0.0/x"),
    ],
)
def test_allowlisted_ip_literals_that_are_not_public_are_refused(host, target):
    with pytest.raises(MediaError, match="not public"):
        load_url(target, MediaPolicy(allowed_media_domains=(host,), fetch_timeout_s=2))


def test_one_non_public_address_refuses_the_host(monkeypatch):
    fake_dns(monkeypatch, {"mixed.test": ["93.184.216.34", "10.0.0.1"]})
    with pytest.raises(MediaError, match="resolves to 10.0.0.1"):
        load_url("http://mixed.test/x", MediaPolicy(allowed_media_domains=("mixed.test",), fetch_timeout_s=2))


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


@pytest.mark.parametrize(
    "target",
    ["ftp://localhost/img.png", "gopher://localhost/", "javascript:alert(1)", "data:image/png;base64,iVBORw0KGgo=",
     "mailto:a@localhost", "ws://localhost/"],
)
def test_other_schemes_are_refused(target, tmp_path):
    with pytest.raises(MediaError, match="is not supported here"):
        load_url(target, remote(allowed_local_media_path=str(tmp_path)))


def test_empty_url_is_refused():
    with pytest.raises(MediaError, match="empty"):
        load_url("", remote())


# ---- remote: redirects, status, size, time -----------------------------------------------


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


# ---- remote: TLS -------------------------------------------------------------------------


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


# ---- local files --------------------------------------------------------------------------


@pytest.fixture
def root(tmp_path):
    """tmp/root holds img.png, "my image.png" and sub/; tmp/secret.png and tmp/root2/img.png lie outside."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "img.png").write_bytes(PNG)
    (root / "my image.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"secret")
    (tmp_path / "root2").mkdir()
    (tmp_path / "root2" / "img.png").write_bytes(b"sibling")
    return root


def local(root, **overrides):
    return MediaPolicy(allowed_local_media_path=str(root), **overrides)


def test_local_files_are_off_by_default(root):
    for target in (str(root / "img.png"), (root / "img.png").as_uri(), "img.png"):
        with pytest.raises(MediaError, match="local media files are off; set allowed_local_media_path"):
            load_url(target, MediaPolicy())


def test_files_inside_the_root_are_read(root, monkeypatch):
    monkeypatch.chdir(root.parent / "root2")  # relative paths are taken from the root, not the working directory
    targets = [
        (root / "img.png").as_uri(),
        f"file://localhost{root}/img.png",
        (root / "my image.png").as_uri(),  # percent-encoded: my%20image.png
        str(root / "img.png"),
        "img.png",
        "./sub/../img.png",
    ]
    for target in targets:
        assert load_url(target, local(root)) == PNG, target


def test_symlinks_inside_the_root_and_a_symlinked_root_are_fine(root):
    (root / "alias.png").symlink_to(root / "img.png")
    (root.parent / "rootlink").symlink_to(root)
    assert load_url("alias.png", local(root)) == PNG
    assert load_url(str(root.parent / "rootlink" / "img.png"), local(root.parent / "rootlink")) == PNG


@pytest.mark.parametrize(
    "target",
    ["../secret.png", "{root}/../secret.png", "file://{root}/../secret.png", "{tmp}/secret.png", "/etc/hostname"],
)
def test_dot_dot_and_absolute_paths_cannot_escape(root, target):
    with pytest.raises(MediaError, match="outside allowed_local_media_path"):
        load_url(target.format(root=root, tmp=root.parent), local(root))


def test_symlink_escaping_the_root_is_refused(root):
    (root / "escape.png").symlink_to(root.parent / "secret.png")
    (root / "up").symlink_to(root.parent)
    for target in ("escape.png", str(root / "escape.png"), "up/secret.png"):
        with pytest.raises(MediaError, match="outside allowed_local_media_path"):
            load_url(target, local(root))


def test_sibling_directory_with_the_root_as_prefix_is_refused(root):
    for target in (str(root.parent / "root2" / "img.png"), "../root2/img.png"):
        with pytest.raises(MediaError, match="outside allowed_local_media_path"):
            load_url(target, local(root))


def test_directories_are_refused(root):
    for target in ("sub", ".", str(root)):
        with pytest.raises(MediaError, match="is a directory"):
            load_url(target, local(root))


def test_missing_file_is_refused(root):
    with pytest.raises(MediaError, match="no file 'nope.png'"):
        load_url("nope.png", local(root))


def test_special_files_are_refused(root):
    os.mkfifo(root / "pipe")  # opening it must not wait for a writer
    with pytest.raises(MediaError, match="not a regular file"):
        load_url("pipe", local(root))
    with pytest.raises(MediaError, match="not a regular file"):
        load_url("/dev/zero", MediaPolicy(allowed_local_media_path="/dev"))


def test_oversize_local_file_is_refused(root):
    (root / "big.bin").write_bytes(b"x" * (LIMIT + 1))
    (root / "exact.bin").write_bytes(b"x" * LIMIT)
    with pytest.raises(MediaError, match=f"is {LIMIT + 1} bytes; the limit is max_item_bytes={LIMIT}"):
        load_url("big.bin", local(root, max_item_bytes=LIMIT))
    assert len(load_url("exact.bin", local(root, max_item_bytes=LIMIT))) == LIMIT


def test_file_urls_naming_another_host_or_a_nul_byte_are_refused(root):
    with pytest.raises(MediaError, match="file:///absolute/path"):
        load_url(f"file://fileserver{root}/img.png", local(root))
    with pytest.raises(MediaError, match="NUL byte"):
        load_url(f"file://{root}/img%00.png", local(root))


# ---- the policy itself -------------------------------------------------------------------


def test_policy_takes_lists_and_refuses_bad_entries():
    policy = MediaPolicy(allowed_media_domains=["example.com"], allowed_private_networks=["10.0.0.0/8"])
    assert policy.allowed_media_domains == ("example.com",) and hash(policy)
    with pytest.raises(MediaError, match="allowed_media_domains must be a list"):
        MediaPolicy(allowed_media_domains="example.com")
    with pytest.raises(MediaError, match="allowed_private_networks"):
        MediaPolicy(allowed_private_networks=("10.0.0.300/8",))
