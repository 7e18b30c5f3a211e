"""The lean decoder (mindspeed.generate.lean_decoder) against Megatron-Core's own forward: the
same logits at every position after the prompt, by cached steps and by recomputed prefixes, for
the Llama, GPT-2 and Qwen2 layouts (grouped queries, q/k/v biases, tied output, partial RoPE) at
TP1 and TP2; the generator's greedy tokens by both paths; the models it leaves to Megatron-Core."""
import pytest

from tests_extend.distributed.harness import run_distributed
from tests_extend.unit import lean_decoder_workers as workers

TOLERANCE = 1e-5          # relative to the logits' scale: fp32 sums in another order


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("layout", list(workers.LAYOUTS))
def test_lean_logits_equal_megatrons_forward(layout, tp):
    for report in run_distributed(workers.logits_against_megatron, world_size=tp, args=(layout,), timeout=300):
        assert report["vocab"] == workers.VOCAB                    # every rank sees the whole vocabulary
        assert report["scale"] > 1.0
        assert report["cached"] <= TOLERANCE * report["scale"], report
        assert report["recomputed"] <= TOLERANCE * report["scale"], report


def test_generator_tokens_are_the_same_on_both_paths():
    (out,) = run_distributed(workers.tokens_by_each_path, world_size=1, args=("qwen2",), timeout=300)
    assert out["lean=True cache=True"][0] and not out["lean=False cache=True"][0]
    tokens = {tuple(t) for _, t in out.values()}
    assert len(tokens) == 1, out
    assert len(set(next(iter(tokens)))) >= 4, out         # a continuation that tells models apart


def test_models_beyond_it_go_to_megatrons_path():
    (reasons,) = run_distributed(workers.refusals, world_size=1, timeout=300)
    assert "bfloat16" in reasons["bf16"]
    assert "MoELayer" in reasons["moe"], reasons
