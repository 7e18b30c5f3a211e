"""`python -m mindspeed.torchrun` on a rendezvous port another process already listens on: one line
that names the port and how to choose another, exit code 1, no traceback (torchrun's own report is
a traceback from its TCPStore)."""
import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_taken_rendezvous_port_ends_in_one_line(tmp_path):
    script = tmp_path / "never_runs.py"
    script.write_text("raise SystemExit('a worker started')\n")
    with socket.socket() as held:           # what another job's launcher holds
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "mindspeed.torchrun", "--nproc_per_node", "1", "--nnodes", "1",
                                 "--master_addr", "127.0.0.1", "--master_port", str(port), str(script)],
                                capture_output=True, text=True, timeout=120, cwd=ROOT,
                                env=dict(os.environ, PYTHONPATH=ROOT))
    lines = [line for line in result.stderr.splitlines() if line.startswith("torchrun:")]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines == [f"torchrun: the rendezvous port {port} is already in use on this machine (another job, or one "
                     "still ending); give a free one (MASTER_PORT for the launch scripts, --master_port or "
                     "--rdzv-endpoint for torchrun)"], result.stderr[-3000:]
    assert "a worker started" not in result.stderr
