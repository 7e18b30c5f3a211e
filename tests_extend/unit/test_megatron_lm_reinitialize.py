"""Megatron-LM's initialize run again in one process (Megatron-Core's own tests validate args once per
test): the same flags keep what is applied, other flags replace the last plan's features (issue 58:
the second run raised PatchError on apply_rotary_pos_emb)."""
import mindspeed
from mindspeed.flags.trainer_flags import parse_args
from mindspeed.megatron_lm import MegatronLMHooks

ROPE = ["--mock-data", "--use-fused-rotary-pos-emb", "--position-embedding-type", "rope"]
RMSNORM = ["--mock-data", "--use-fused-rmsnorm", "--normalization", "RMSNorm"]
ROPE_TARGET = "megatron.core.transformer.attention.apply_rotary_pos_emb"


def test_validate_args_again_keeps_the_same_plan_and_replaces_another():
    session = mindspeed.adapt(["--device", "cpu"])
    try:
        hooks = MegatronLMHooks(session, msadapter=False)
        shim = session.patcher.applied()
        hooks._after_megatron(parse_args(ROPE))
        first = session.patcher.applied()
        assert session.patcher.find(ROPE_TARGET) is not None

        hooks._after_megatron(parse_args(ROPE))          # the same flags: nothing re-applied, nothing raised
        again = session.patcher.applied()
        assert len(again) == len(first) and all(a is b for a, b in zip(again, first))

        hooks._after_megatron(parse_args(RMSNORM))       # other flags: rope's patch undone, rmsnorm's applied
        assert session.feature_ids == ("fused-rmsnorm",)
        assert session.patcher.find(ROPE_TARGET) is None
        replaced = session.patcher.applied()
        assert all(a is b for a, b in zip(replaced, shim)) and len(replaced) > len(shim)

        hooks._after_megatron(parse_args(ROPE))          # and back: rmsnorm's patches undone
        assert session.feature_ids == ("fused-rotary-pos-emb",)
        assert [p.target for p in session.patcher.applied()[len(shim):]] == [ROPE_TARGET]
    finally:
        mindspeed.unadapt()
