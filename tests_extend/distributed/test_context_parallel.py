"""Context parallelism on the torch backend, 2 and 4 gloo processes: every algorithm's output and
q/k/v gradients equal single-process attention on the whole sequence."""
import pytest

from tests_extend.distributed.harness import run_distributed


def _body(rank, world_size):
    from tests_extend.distributed import cp_cases, torch_kit
    return cp_cases.run_all(torch_kit, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_attention_matches_single_process(world_size):
    results = run_distributed(_body, world_size=world_size, timeout=240)
    labels = {label for label, _, _ in __import__("tests_extend.distributed.cp_cases",
                                                    fromlist=["x"]).cases_for(world_size)}
    for per_rank in results:
        assert {k.split("/")[0] for k in per_rank} == labels
        assert len(per_rank) == len(labels) * 8
