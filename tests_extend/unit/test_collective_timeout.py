"""The torch trainer's one line for a collective that a rank never joined (collective_timeout): the
roll call that names the missing ranks of a group larger than two, over a real TCPStore (the kind
torch.distributed's default store is), and the flag that sets the timeout. The whole path, a rank
stopped in a real job, is tested in tests_extend/system/test_pretrain_gpt.py."""
import datetime
import threading
import time

import pytest
from torch.distributed import TCPStore

from mindspeed.errors import ArgumentError
from mindspeed.flags.trainer_flags import parse_args
from mindspeed.net import free_port
from mindspeed.training import collective_timeout


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", free_port(), is_master=True, timeout=datetime.timedelta(seconds=10))


def _answer_later(store, rank, after_s):
    client = TCPStore(store.host, store.port, is_master=False)

    def answer():
        time.sleep(after_s)
        collective_timeout.roll_call(client, [rank], rank, wait_s=0.1)
    thread = threading.Thread(target=answer)
    thread.start()
    return thread


def test_the_roll_call_names_the_ranks_that_never_answer(store):
    late = _answer_later(store, 1, 0.3)            # timed out a little after rank 0
    started = time.monotonic()
    assert collective_timeout.roll_call(store, [0, 1, 2, 3], 0, wait_s=1.5) == [2, 3]
    assert 1.5 <= time.monotonic() - started < 5
    late.join()


def test_the_roll_call_ends_as_soon_as_every_rank_answered(store):
    for rank in (1, 2):
        _answer_later(store, rank, 0).join()
    started = time.monotonic()
    assert collective_timeout.roll_call(store, [0, 1, 2], 0, wait_s=5) is None
    assert time.monotonic() - started < 2


def test_a_store_that_does_not_answer_gives_no_names():
    class Gone:
        def set_timeout(self, _timeout):
            pass

        def set(self, key, value):
            raise RuntimeError("Connection reset by peer")

    assert collective_timeout.roll_call(Gone(), [0, 1, 2], 0, wait_s=0.1) is None


def test_other_errors_are_not_taken_for_a_timeout():
    assert collective_timeout.one_line_error(RuntimeError("shape mismatch"), 1.0) is None
    assert collective_timeout.one_line_error(ValueError("Timed out waiting 60000ms"), 1.0) is None


def test_the_timeout_flag_takes_fractions_of_a_minute_and_refuses_the_rest():
    assert parse_args(["--distributed-timeout-minutes", "0.5"], world_size=1).distributed_timeout_minutes == 0.5
    assert parse_args([], world_size=1).distributed_timeout_minutes == 10
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(ArgumentError, match="give a positive number of minutes"):
            parse_args(["--distributed-timeout-minutes", bad], world_size=1)
    with pytest.raises(ArgumentError, match="invalid float value: 'soon'"):
        parse_args(["--distributed-timeout-minutes", "soon"], world_size=1)


SETUP_ALONE = """
import os, sys, types
from mindspeed.net import free_port
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
from mindspeed.errors import CollectiveTimeout
from mindspeed.training import pretrain
args = types.SimpleNamespace(distributed_backend="gloo", distributed_timeout_minutes=10, tensor_model_parallel_size=1,
                             pipeline_model_parallel_size=1, num_layers_per_virtual_pipeline_stage=None,
                             context_parallel_size=1, expert_model_parallel_size=1)
try:
    pretrain._init_distributed(args, "cpu", setup_minutes=0.05)
except CollectiveTimeout as err:
    print("ONE LINE:", err)
"""


def test_a_rank_missing_from_the_setup_is_one_line():
    """Rank 0 of a job of two alone at the setup (the real rendezvous, over torch's TCPStore, with a
    3 s setup timeout instead of the trainer's 10 minutes): one line saying how many processes joined
    and what to check, not the store's traceback."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", SETUP_ALONE], cwd=root, capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, PYTHONPATH=root))
    lines = [line for line in result.stdout.splitlines() if line.startswith("ONE LINE:")]
    assert lines == ["ONE LINE: rank 0: the job's processes did not all join its setup within 3 s: 1 of 2 processes "
                     "joined (a rank that never started or hangs before its setup, or one given another "
                     "MASTER_ADDR/MASTER_PORT); stopping"], result.stdout[-2000:] + result.stderr[-2000:]
