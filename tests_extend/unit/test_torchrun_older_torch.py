"""`python -m mindspeed.torchrun` under a torch whose torchrun has no `--shutdown-timeout` (before
2.13: a GPU machine's own torch 2.11 failed the launch script with "unrecognized arguments"). Its
parser here is torch 2.13's less that option, which is what torch 2.11's is for these arguments."""
import pytest
from torch.distributed.run import get_args_parser

from mindspeed.torchrun import SHUTDOWN_FLAGS, LauncherError, for_this_torchrun

SCRIPT_ARGS = ["pretrain_gpt.py", "--shutdown-timeout", "99", "--lr", "1e-3"]   # the script's own, untouched


def _older_parser():
    parser = get_args_parser()
    for flag in SHUTDOWN_FLAGS:
        parser._option_string_actions.pop(flag, None)     # absent already before torch 2.13
    return parser


def test_a_torchrun_with_the_option_keeps_it():
    if SHUTDOWN_FLAGS[0] not in get_args_parser()._option_string_actions:
        pytest.skip("this torch's torchrun has no --shutdown-timeout")
    argv = ["--max-restarts", "0", "--shutdown-timeout", "45", "--nproc_per_node", "2", *SCRIPT_ARGS]
    assert for_this_torchrun(argv) == argv


@pytest.mark.parametrize("flag", [["--shutdown-timeout", "30"], ["--shutdown_timeout=30"]])
def test_an_older_torchrun_drops_its_own_fixed_wait(flag):
    argv = ["--max-restarts", "0", *flag, "--nproc_per_node", "2", "--standalone", *SCRIPT_ARGS]
    assert for_this_torchrun(argv, _older_parser()) == ["--max-restarts", "0", "--nproc_per_node", "2",
                                                         "--standalone", *SCRIPT_ARGS]


def test_an_older_torchrun_refuses_another_wait_in_one_line():
    with pytest.raises(LauncherError, match=r"--shutdown-timeout 45: this torchrun \(torch .*\) has no "
                                            r"--shutdown-timeout and gives the workers a fixed 30 s"):
        for_this_torchrun(["--shutdown-timeout", "45", *SCRIPT_ARGS], _older_parser())


def test_option_values_are_not_taken_for_the_script():
    argv = ["--nnodes", "1", "--master_port", "6000", "--shutdown-timeout", "30", *SCRIPT_ARGS]
    assert for_this_torchrun(argv, _older_parser()) == ["--nnodes", "1", "--master_port", "6000", *SCRIPT_ARGS]
