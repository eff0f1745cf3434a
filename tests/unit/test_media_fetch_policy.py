"""``encoder.media_fetch``: the MediaPolicy's rules, checked before any connection is made.

Which hosts an allowlist admits, which addresses count as public and which
``allowed_private_networks`` opens, IP literals and DNS answers that are refused
without connecting, the URL schemes that are never fetched, and the policy's own
validation of its settings. Nothing here reaches a server: every address is refused
(or only compared) before a connection would be made, which is what the tests check.
"""

from __future__ import annotations

import pytest
from media_servers import fake_dns, remote

from encoder.media_fetch import MediaPolicy, address_allowed, host_allowed, load_url
from encoder.media import MediaError


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


def test_policy_takes_lists_and_refuses_bad_entries():
    policy = MediaPolicy(allowed_media_domains=["example.com"], allowed_private_networks=["10.0.0.0/8"])
    assert policy.allowed_media_domains == ("example.com",) and hash(policy)
    with pytest.raises(MediaError, match="allowed_media_domains must be a list"):
        MediaPolicy(allowed_media_domains="example.com")
    with pytest.raises(MediaError, match="allowed_private_networks"):
        MediaPolicy(allowed_private_networks=("10.0.0.300/8",))
