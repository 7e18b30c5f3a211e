"""mindspeed/files.py: the one cache root, and writes that never leave half a file."""
import os

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
