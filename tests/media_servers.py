"""A local HTTP(S) server of test media, and the policies and DNS answers that let ``encoder.media_fetch`` reach it.

The server listens on 127.0.0.1 only and answers fixed routes: the image
(``PNG``), bodies that are too big, cut short or trickled, and redirects to
places a policy must refuse. Tests that want a fetch to succeed name it
``localhost`` and allow the loopback networks explicitly (``remote()``), as a
deployment would; ``fake_dns`` makes other names resolve where a test says
without any real lookup. The certificate is self-signed for ``localhost`` only,
so the TLS tests can tell a hostname check from a pinned-address check.
"""

from __future__ import annotations

import http.server
import socket
import threading
import time

from support import image_bytes

from encoder.media_fetch import MediaPolicy

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


def serve(tls_context=None):
    """Start the server on a free 127.0.0.1 port in a daemon thread; ``seen`` lists each request's (path, Host)."""
    server = _Server(("127.0.0.1", 0), _Handler)
    server.seen = []
    if tls_context is not None:
        server.socket = tls_context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def url(server, path, host="localhost", scheme="http"):
    return f"{scheme}://{host}:{server.server_address[1]}{path}"


# ---- reaching it -----------------------------------------------------------------------


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
