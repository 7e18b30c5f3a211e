"""exit_after_cleanup: the exit handlers run (MindSpore's own cleanup is one), the status is kept,
and Python's teardown does not run (where MindSpore's exit crash happened: docs/native-crash.md)."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import atexit, os, sys
    from mindspeed.backends.mindspore.process_exit import exit_after_cleanup

    class Held:                     # freed only by the teardown of this module
        def __del__(self, _open=os.open, _path=sys.argv[1] + ".teardown", _flags=os.O_CREAT | os.O_WRONLY):
            _open(_path, _flags)    # what it needs is bound now: the teardown clears modules

    held = Held()
    atexit.register(lambda: open(sys.argv[1] + ".handler", "w").close())
    print("work done", flush=False)  # still buffered: the exit flushes it
    exit_after_cleanup(int(sys.argv[2]))
""")


def test_handlers_run_the_status_is_kept_and_the_teardown_is_skipped(tmp_path):
    mark = str(tmp_path / "mark")
    out = subprocess.run([sys.executable, "-c", SCRIPT, mark, "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert out.stdout == "work done\n"
    assert (tmp_path / "mark.handler").exists()
    assert not (tmp_path / "mark.teardown").exists()


def test_a_plain_exit_does_run_the_teardown(tmp_path):
    """The check above can fail: without exit_after_cleanup the teardown frees the object."""
    mark = str(tmp_path / "mark")
    plain = SCRIPT.replace("exit_after_cleanup(int(sys.argv[2]))", "sys.exit(int(sys.argv[2]))")
    out = subprocess.run([sys.executable, "-c", plain, mark, "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "mark.teardown").exists()
