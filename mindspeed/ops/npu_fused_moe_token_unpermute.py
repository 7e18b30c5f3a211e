"""Upstream's docs/ops/npu_fused_moe_token_unpermute.md page name as a module: the same op as
`mindspeed.ops.npu_moe_token_unpermute` (the import path that page documents)."""
from mindspeed.ops.npu_moe_token_unpermute import npu_moe_token_unpermute

__all__ = ["npu_moe_token_unpermute"]
