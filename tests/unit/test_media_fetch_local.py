"""``encoder.media_fetch``: local media files, read only from under ``allowed_local_media_path``.

Real files in a temporary tree: paths and ``file://`` URLs inside the root are
read, relative ones from the root rather than the working directory; ``..``,
absolute paths, symlinks and sibling folders that lead outside it are refused, as
are directories, missing and special files, files over ``max_item_bytes`` and
``file://`` URLs that name another host or hold a NUL byte.
"""

from __future__ import annotations

import os

import pytest
from media_servers import LIMIT, PNG

from encoder.media_fetch import MediaPolicy, load_url
from encoder.media import MediaError


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
