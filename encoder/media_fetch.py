"""Fetching media bytes from http(s) URLs and local files, under an explicit ``MediaPolicy``.

Everything is off by default; ``data:`` URIs are the caller's (``items.item_media``). Each remote
hop (the URL asked for, then each redirect target) is checked (scheme, no userinfo, host allowlist),
then resolved ONCE: any non-public address not in ``allowed_private_networks`` refuses it.
``http.client`` gets a socket already connected to a checked address, so the name is never resolved
again (no DNS rebinding); Host, SNI and the certificate check use the URL's host. One deadline covers
all hops: every send and receive, header lines included, gets the time left, so a trickling server
is cut off. Bodies are streamed and cut at ``max_item_bytes``. Known gaps: ``getaddrinfo`` takes no
timeout (the system resolver's applies); each TLS handshake read gets the time left, not a share.
"""

from __future__ import annotations

import dataclasses
import http.client
import io
import ipaddress
import os
import socket
import ssl
import stat
import time
import urllib.parse
from typing import Iterable

from encoder.media import MediaError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK_BYTES = 64 * 1024
_SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT; 3.11 flags it only via is_global


@dataclasses.dataclass(frozen=True)
class MediaPolicy:
    """What ``load_url`` may read; the defaults refuse every URL and path."""

    allowed_media_domains: tuple[str, ...] = ()  # "example.com", "*.example.com", an IP; empty: remote off
    allow_redirects: bool = False
    max_redirects: int = 3
    allowed_local_media_path: str | None = None  # the directory local files may come from; None: off
    allowed_private_networks: tuple[str, ...] = ()  # CIDRs reachable although non-public
    fetch_timeout_s: float = 10.0  # the whole remote fetch: all hops, connect to last byte
    max_item_bytes: int = 20 * 1024 * 1024  # the largest body or file accepted

    def __post_init__(self) -> None:
        # Lists (YAML, JSON) become tuples so the policy stays hashable; a bare string would not.
        for key in ("allowed_media_domains", "allowed_private_networks"):
            value = getattr(self, key)
            if isinstance(value, str) or not all(isinstance(entry, str) and entry for entry in value):
                raise MediaError(f"{key} must be a list of non-empty strings, got {value!r}")
            object.__setattr__(self, key, tuple(value))
        _parse_networks(self.allowed_private_networks)


def load_url(url: str, policy: MediaPolicy) -> bytes:
    """Bytes behind an http(s):// URL, a file:// URL or a plain local path; MediaError otherwise.
    Relative paths are taken from ``allowed_local_media_path`` (write ``./a:b.png``, not ``a:b.png``)."""
    if not url:
        raise MediaError("the media URL is empty")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise MediaError(f"the media URL is malformed ({exc})") from None
    if parts.scheme in ("http", "https"):
        return _fetch_remote(url, policy)
    if parts.scheme == "file":
        if parts.netloc.lower() not in ("", "localhost") or not parts.path.startswith("/"):
            raise MediaError(f"file URLs must read file:///absolute/path (no other host); got {url!r}")
        return _read_local(urllib.parse.unquote(parts.path), policy)
    if parts.scheme == "":
        return _read_local(url, policy)
    raise MediaError(f"URL scheme {parts.scheme!r} is not supported here; use http(s)://, file:// or a local path")


def host_allowed(host: str, allowed_domains: Iterable[str]) -> bool:
    """Whether ``host`` is on the allowlist: ``example.com`` matches that host only,
    ``*.example.com`` any name below example.com but not example.com itself; case and
    one trailing dot are ignored. An IP-literal host matches only the same address."""
    host_ip, name = _ip_literal(host), host.lower().removesuffix(".")
    for entry in allowed_domains:
        entry_ip, entry = _ip_literal(entry), entry.lower().removesuffix(".")
        if host_ip is not None or entry_ip is not None:
            matched = host_ip == entry_ip
        elif entry.startswith("*."):
            matched = name.endswith(entry[1:]) and bool(name[: 1 - len(entry)].strip("."))
        else:
            matched = name == entry
        if matched:
            return True
    return False


def address_allowed(address: str | IPAddress, allowed_networks: Iterable[str | IPNetwork] = ()) -> bool:
    """Whether a resolved address may be connected to: it (and the IPv4 address inside it:
    ``::ffff:127.0.0.1``, 6to4) is public, or it is in one of ``allowed_networks``. Not public:
    private, loopback, link-local (cloud metadata 169.254.169.254 too), multicast, reserved
    (NAT64's 64:ff9b::/96 too), unspecified, shared 100.64.0.0/10, site-local."""
    ip = ipaddress.ip_address(address) if isinstance(address, str) else address
    candidates = [ip]
    if ip.version == 6:
        embedded = ip.ipv4_mapped or ip.sixtofour
        candidates += [embedded] if embedded is not None else []
    networks = _parse_networks(allowed_networks)
    if any(candidate in network for candidate in candidates for network in networks):
        return True
    return all(_is_public(candidate) for candidate in candidates)


def _is_public(ip: IPAddress) -> bool:
    flagged = (
        ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_reserved
        or ip.is_unspecified or ip in _SHARED_ADDRESS_SPACE or (ip.version == 6 and ip.is_site_local)
    )
    return ip.is_global and not flagged


def _ip_literal(text: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def _parse_networks(entries: Iterable[str | IPNetwork]) -> list[IPNetwork]:
    try:
        return [ipaddress.ip_network(entry, strict=False) if isinstance(entry, str) else entry for entry in entries]
    except ValueError as exc:
        raise MediaError(f"allowed_private_networks: {exc}; use CIDR notation, e.g. \"10.0.0.0/8\"") from None


def _fetch_remote(url: str, policy: MediaPolicy) -> bytes:
    if not policy.allowed_media_domains:
        raise MediaError("remote media fetching is off; set allowed_media_domains, or send the image as a data: URI")
    networks = _parse_networks(policy.allowed_private_networks)
    deadline = time.monotonic() + policy.fetch_timeout_s
    for _ in range(policy.max_redirects + 1):
        scheme, host, port, target = _check_remote_url(url, policy)
        try:
            with _connect(host, port, networks, deadline) as sock:
                status, location, body = _get(sock, scheme, host, port, target, policy, deadline)
        except TimeoutError:
            raise MediaError(f"fetching {url} took longer than fetch_timeout_s={policy.fetch_timeout_s}s") from None
        except (OSError, http.client.HTTPException, UnicodeError) as exc:
            raise MediaError(f"could not fetch {url} ({exc.__class__.__name__}: {exc})") from None
        if location is None:
            return body
        if not policy.allow_redirects:
            raise MediaError(f"{url} redirects (HTTP {status}) to {location}; set allow_redirects to follow it")
        url = urllib.parse.urljoin(url, location)
    raise MediaError(f"more than max_redirects={policy.max_redirects} redirects; the last went to {url}")


def _check_remote_url(url: str, policy: MediaPolicy) -> tuple[str, str, int, str]:
    """(scheme, host, port, request target) of a URL that passes the scheme and host rules."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise MediaError(f"the URL {url!r} is malformed ({exc})") from None
    if parts.scheme not in ("http", "https"):
        raise MediaError(f"{url!r}: only http:// and https:// URLs are fetched from remote hosts")
    if "@" in parts.netloc:
        raise MediaError(f"{url!r} carries credentials (user:password@host); those are refused, remove them")
    host = parts.hostname
    if not host or not host_allowed(host, policy.allowed_media_domains):
        raise MediaError(f"host {host!r} is not in allowed_media_domains; add it (or a *.parent wildcard) to fetch it")
    return parts.scheme, host, port, (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def _connect(host: str, port: int, networks: list[IPNetwork], deadline: float) -> socket.socket:
    """A socket connected to one of ``host``'s addresses, all of which passed the address rules."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise MediaError(f"cannot resolve host {host!r} ({exc})") from None
    for *_, sockaddr in infos:
        if not address_allowed(sockaddr[0], networks):
            raise MediaError(f"{host} resolves to {sockaddr[0]}, not public; allow it in allowed_private_networks")
    error = OSError("the host resolved to no address")
    for family, _, _, _, sockaddr in infos:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            _arm(sock, deadline)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise
            error = exc
    raise error


def _get(sock, scheme, host, port, target, policy, deadline) -> tuple[int, str | None, bytes]:
    """(status, redirect location or None, body) of one GET over the connected ``sock``."""
    if scheme == "https":
        context = ssl.create_default_context()
        _arm(sock, deadline)
        sock = context.wrap_socket(sock, server_hostname=host)
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(host, port, context=context)
    else:
        conn = http.client.HTTPConnection(host, port)
    conn.sock = _DeadlineSocket(sock, deadline)  # with a socket set, http.client never connects nor resolves
    with sock:  # the TLS socket, when there is one
        conn.request("GET", target, headers={"Accept": "image/*, */*;q=0.5"})
        response = conn.getresponse()
        location = response.getheader("Location")
        if response.status in _REDIRECT_STATUSES and location:
            return response.status, location, b""
        if not 200 <= response.status < 300:
            raise MediaError(f"{host}{target} answered HTTP {response.status} {response.reason}; expected 200")
        return response.status, None, _read_body(response, policy)


def _arm(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the fetch deadline has passed")
    sock.settimeout(left)


class _DeadlineSocket(io.RawIOBase):
    """``http.client``'s socket and response file: each send and receive gets the time left before the
    deadline. ``close`` does nothing: http.client closes its socket while the response is still read."""

    def __init__(self, sock: socket.socket, deadline: float):
        self._sock, self._deadline = sock, deadline

    def sendall(self, data: bytes) -> None:
        _arm(self._sock, self._deadline)
        self._sock.sendall(data)

    def makefile(self, mode: str = "rb", *args, **kwargs) -> io.BufferedReader:
        return io.BufferedReader(self)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        _arm(self._sock, self._deadline)
        return self._sock.recv_into(buffer)

    def close(self) -> None:
        pass


def _read_body(response: http.client.HTTPResponse, policy: MediaPolicy) -> bytes:
    length = response.length  # from Content-Length; None when chunked or close-delimited
    if length is not None and length > policy.max_item_bytes:
        raise MediaError(f"the body is {length} bytes (Content-Length); the limit is max_item_bytes={policy.max_item_bytes}")
    chunks, total = [], 0
    while chunk := response.read1(_CHUNK_BYTES):  # read1: what has arrived, not a full chunk
        total += len(chunk)
        if total > policy.max_item_bytes:
            raise MediaError(f"the body is larger than max_item_bytes={policy.max_item_bytes}; stopped reading")
        chunks.append(chunk)
    if length is not None and total < length:
        raise MediaError(f"the server closed the connection after {total} of {length} bytes")
    return b"".join(chunks)


def _read_local(path: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_media_path is None:
        raise MediaError("local media files are off; set allowed_local_media_path to the directory they may come from")
    root = os.path.realpath(policy.allowed_local_media_path)
    if not os.path.isdir(root):
        raise MediaError(f"allowed_local_media_path {policy.allowed_local_media_path!r} is not a directory")
    if "\0" in path:
        raise MediaError("the local path contains a NUL byte")
    # An absolute path replaces the root; realpath resolves ".." and symlinks before the check.
    resolved = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, resolved]) != root:
        raise MediaError(f"{path!r} is outside allowed_local_media_path ({policy.allowed_local_media_path})")
    try:
        # NOFOLLOW: a symlink swapped in after the check is refused. NONBLOCK: a FIFO must not wait for a writer.
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MediaError(f"no file {path!r} under allowed_local_media_path") from None
    except OSError as exc:
        raise MediaError(f"cannot open {path!r} ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file"
            raise MediaError(f"{path!r} is {kind}; name an image file")
        if info.st_size > policy.max_item_bytes:
            raise MediaError(f"{path!r} is {info.st_size} bytes; the limit is max_item_bytes={policy.max_item_bytes}")
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read(policy.max_item_bytes + 1)  # one byte past the limit: the file may grow after fstat
    finally:
        os.close(fd)
    if len(data) > policy.max_item_bytes:
        raise MediaError(f"{path!r} is larger than max_item_bytes={policy.max_item_bytes}")
    return data
