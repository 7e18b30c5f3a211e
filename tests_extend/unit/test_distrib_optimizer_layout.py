"""The MindSpore distributed optimizer's flat layout (distrib_optimizer.FlatLayout): DP equal slices
that together cover every parameter value once, decayed values first, each owned run tagged with
its weight-decay group, padding only at the end."""
import pytest

pytest.importorskip("mindspore")

from mindspeed.training.mindspore.distrib_optimizer import FlatLayout  # noqa: E402

SHAPES = {"embedding.word_embeddings.weight": (7, 3), "decoder.final_layernorm.weight": (3,),
          "decoder.layers.0.mlp.linear_fc1.weight": (5, 3), "output_layer.bias": (4,),
          "output_layer.weight": (4, 3)}


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_slices_cover_the_buffer_once_with_their_decay_group(dp):
    layouts = [FlatLayout(SHAPES, dp, r) for r in range(dp)]
    total = 21 + 3 + 15 + 4 + 12
    assert all(l.total == total for l in layouts)
    decayed = 21 + 15 + 12        # 2-D, not biases
    assert layouts[0].order[:3] == ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                                    "output_layer.weight"]
    owned = sorted((s, e, d) for l in layouts for s, e, d in l.runs)
    covered = [i for s, e, _ in owned for i in range(s, e)]
    assert covered == list(range(total))             # every value owned by exactly one rank
    assert all(d == (s < decayed) and (e <= decayed or s >= decayed) for s, e, d in owned)
    assert {l.shard for l in layouts} == {-(-total // dp)} and layouts[0].padded - total < dp
    offsets = layouts[0].offsets()
    assert offsets["output_layer.weight"] == (36, 48) and offsets["output_layer.bias"] == (51, 55)


def test_too_many_ranks_for_the_values_is_refused_in_one_line():
    with pytest.raises(ValueError, match="cannot give each of 8 data-parallel ranks a part"):
        FlatLayout({"w": (2, 2)}, 8, 7)
