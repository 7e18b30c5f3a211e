"""mindspeed/files.py: the one cache root, and writes that never leave half a file."""
import os
import tarfile

import pytest

from mindspeed import files


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = str(tmp_path / "tracker.txt")
    files.atomic_write(path, lambda tmp: open(tmp, "w").write("4"))
    assert oct(os.stat(path).st_mode & 0o777) == oct(files.PRIVATE_FILE)

    def crash(tmp):
        with open(tmp, "w") as f:
            f.write("half of 8")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.atomic_write(path, crash)
    assert open(path).read() == "4"
    assert os.listdir(tmp_path) == ["tracker.txt"]


def test_one_variable_moves_every_cache(monkeypatch, tmp_path):
    from mindspeed.backends.torch.kernels import csrc
    from mindspeed.data import shakespeare
    monkeypatch.setenv("MINDSPEED_CACHE_DIR", str(tmp_path))
    assert shakespeare.cache_dir().startswith(str(tmp_path))
    assert str(csrc.cache_dir()).startswith(str(tmp_path))
    monkeypatch.delenv("MINDSPEED_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert files.cache_root() == str(tmp_path / "xdg" / "mindspeed")


def _archive(path, members):
    """members: (name, kind, payload): kind file (payload text), dir, sym/hard (payload target), fifo, chr."""
    import io
    types = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "hard": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE,
             "chr": tarfile.CHRTYPE}
    with tarfile.open(path, "w") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                data = payload.encode()
                info.size, info.mode = len(data), 0o6777       # setuid/setgid and world-writable
                tar.addfile(info, io.BytesIO(data))
                continue
            info.type = types[kind]
            if kind in ("sym", "hard"):
                info.linkname = payload
            tar.addfile(info)
    return str(path)


SAFE = [("pkg", "dir", None), ("pkg/a.txt", "file", "A"), ("pkg/link", "sym", "a.txt"),
        ("pkg/up", "sym", "../pkg/a.txt"), ("pkg/c.txt", "file", "C"),
        ("pkg/hard", "hard", "pkg/c.txt")]
UNSAFE = {
    "absolute path": ("/tmp/evil.txt", "file", "x"),
    "dot-dot": ("pkg/../../evil.txt", "file", "x"),
    "symlink leaving": ("pkg/evil", "sym", "../../etc/passwd"),
    "absolute symlink": ("pkg/evil", "sym", "/etc/passwd"),
    "hard link leaving": ("pkg/evil", "hard", "../outside.txt"),
    "fifo": ("pkg/pipe", "fifo", None),
    "device": ("pkg/tty", "chr", None),
}


@pytest.fixture(params=["no-data-filter"] + (["data-filter"] if hasattr(tarfile, "data_filter") else []))
def tar_python(request, monkeypatch):
    """Both tarfiles: 3.11.2's (no filter=) everywhere, and 3.11.4+'s (filter= exists) where it exists."""
    if request.param == "no-data-filter" and hasattr(tarfile, "data_filter"):
        monkeypatch.delattr(tarfile, "data_filter")
    return request.param


def test_safe_extract_unpacks_plain_members_without_special_modes(tmp_path, tar_python):
    dest = tmp_path / "out"
    files.safe_extract(_archive(tmp_path / "ok.tar", SAFE), str(dest))
    assert (dest / "pkg" / "a.txt").read_text() == "A"
    assert os.readlink(dest / "pkg" / "link") == "a.txt" and (dest / "pkg" / "up").read_text() == "A"
    assert (dest / "pkg" / "hard").read_text() == "C"
    assert os.stat(dest / "pkg" / "a.txt").st_mode & 0o7022 == 0      # no setuid/setgid, no g/o write


@pytest.mark.parametrize("case", sorted(UNSAFE))
def test_safe_extract_refuses_members_that_leave_the_folder(tmp_path, tar_python, case):
    archive = _archive(tmp_path / "bad.tar", SAFE + [UNSAFE[case]])
    dest = tmp_path / "out"
    with pytest.raises(files.UnsafeArchive) as info:
        files.safe_extract(archive, str(dest))
    assert UNSAFE[case][0] in str(info.value) and "\n" not in str(info.value)
    assert not dest.exists()                       # refused before anything is written
    assert not (tmp_path / "evil.txt").exists() and not os.path.exists("/tmp/evil.txt")
