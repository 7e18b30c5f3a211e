"""Upstream's docs/ops/npu_fused_moe_token_permute.md page name as a module: the same op as
`mindspeed.ops.npu_moe_token_permute` (the import path that page documents)."""
from mindspeed.ops.npu_moe_token_permute import npu_moe_token_permute

__all__ = ["npu_moe_token_permute"]
