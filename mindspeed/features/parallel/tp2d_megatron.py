"""The Megatron-Core hook of --tp-2d: Megatron builds its plain-TP block, then each layer's QKV, proj,
fc1 and fc2 become 2-D linears (tp2d_ops.py) holding the 2-D chunks of the same whole matrices (the TP
shards all-gathered once at build: the model is the one plain TP at the same size builds), its norms
reduce over the grid's y axis, and the block's forward scatters its input over the grid and gathers
its output (the embedding and the output layer stay Megatron's vocabulary-parallel layers).

Weights in TP order are TP shard after TP shard; the 2-D layers want x-rank after x-rank. x-rank i
takes TP shards i*y .. i*y+y-1 (whole attention head groups, fc1/fc2 columns in order); a gated fc1
shard is [gate; up], so x-rank i's rows are those shards' gates, then their ups.
"""
from __future__ import annotations

import torch

from mindspeed.features.parallel.tp2d_ops import Grid

BLOCK = "megatron.core.transformer.transformer_block.TransformerBlock"
SWIGLU = "megatron.core.transformer.mlp.apply_swiglu_sharded_factory"

#: layers converted, by kind (read by the wiring test)
CONVERTED = {"linear": 0, "norm": 0, "attention": 0}


class Linear2D(torch.nn.Module):
    """A 2-D linear in place of Megatron's Column/RowParallelLinear: (output, bias) as they return."""

    def __init__(self, grid: Grid, weight, bias, ag, rs, skip_bias_add: bool, before=None, gated: bool = False):
        super().__init__()
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
        self.grid, self.ag, self.rs, self.skip_bias_add, self.before = grid, ag, rs, skip_bias_add, before
        self.gated = gated
        self.weight = torch.nn.Parameter(weight.contiguous())
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)      # every rank's chunk differs
        self.bias = None if bias is None else torch.nn.Parameter(bias.contiguous())   # replicated

    def forward(self, x):
        if self.before is not None:
            x = self.before(x)
        out = self.grid.linear(x, self.weight, self.ag, self.rs)
        bias = None if self.bias is None else self._bias_piece()
        if self.skip_bias_add:
            return out, bias
        return (out if bias is None else out + bias), None

    def _bias_piece(self):
        """This rank's chunk of the whole bias (Megatron's layout: a gated fc1's gates, then its ups)."""
        index, parts = self.grid.group_rank(self.ag), self.grid.size(self.ag)
        if not self.gated:
            return self.grid.piece(self.bias, index, parts)
        gate, up = self.bias.chunk(2, 0)
        return torch.cat([self.grid.piece(gate, index, parts), self.grid.piece(up, index, parts)])

    def get_extra_state(self):
        return None                       # as Megatron's linears: the key exists, plain TP's layers expect it

    def set_extra_state(self, state):
        pass

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The weight as the (ag rank, rs rank) block of Megatron's whole matrix (column layers: rows over
        x, columns over y; row layers the other way round), the bias whole: plain TP loads both."""
        from megatron.core.dist_checkpointing.mapping import ShardedTensor
        from megatron.core.parallel_state import get_data_parallel_rank
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        grid, n = self.grid, len(sharded_offsets)
        rest = {k: v for k, v in self.state_dict(keep_vars=True).items() if k != "weight"}
        out = make_sharded_tensors_for_checkpoint(rest, prefix, {}, sharded_offsets)
        axes = [(n, grid.group_rank(self.ag), grid.size(self.ag)), (n + 1, grid.group_rank(self.rs), grid.size(self.rs))]
        out[f"{prefix}weight"] = ShardedTensor.from_rank_offsets(
            f"{prefix}weight", self.weight, *sharded_offsets, *axes,
            replica_id=(0, 0, get_data_parallel_rank(with_context_parallel=True)), prepend_axis_num=n)
        return out


def _x_major(grid: Grid, full, gated: bool):
    """Rows of a column layer's whole weight (or bias), TP shard after TP shard, reordered x-rank after x-rank."""
    if not gated:
        return full
    shards = full.chunk(grid.x * grid.y, 0)
    out = []
    for i in range(grid.x):
        mine = shards[i * grid.y:(i + 1) * grid.y]
        out += [s[:s.shape[0] // 2] for s in mine] + [s[s.shape[0] // 2:] for s in mine]
    return torch.cat(out, 0)


def _whole_bias(grid: Grid, shards_in_order, gated: bool):
    """A column layer's whole bias in Megatron's checkpoint layout (a gated fc1's: every gate, then every up)."""
    if not gated:
        return shards_in_order.clone()
    shards = shards_in_order.chunk(grid.x * grid.y, 0)
    return torch.cat([s[:s.shape[0] // 2] for s in shards] + [s[s.shape[0] // 2:] for s in shards])


def _chunk(t, dim, index, parts):
    return t.chunk(parts, dim)[index]


def column_2d(grid: Grid, layer, gated: bool = False) -> Linear2D:
    """Megatron's ColumnParallelLinear as a 2-D linear: gathers over x, reduces and scatters over y."""
    comm = grid.comm
    with torch.no_grad():
        weight = _x_major(grid, comm.all_gather(layer.weight.detach(), 0, grid.tp_group), gated)
        bias = None if layer.bias is None else _whole_bias(grid, comm.all_gather(layer.bias.detach(), 0, grid.tp_group),
                                                           gated)
    local = _chunk(_chunk(weight, 0, grid.x_rank, grid.x), 1, grid.y_rank, grid.y)
    CONVERTED["linear"] += 1
    return Linear2D(grid, local.clone(), bias, grid.x_group, grid.y_group, layer.skip_bias_add, gated=gated)


def row_2d(grid: Grid, layer, before=None) -> Linear2D:
    """Megatron's RowParallelLinear as a 2-D linear: gathers over y, reduces and scatters over x."""
    with torch.no_grad():
        weight = grid.comm.all_gather(layer.weight.detach(), 1, grid.tp_group)
    local = _chunk(_chunk(weight, 0, grid.y_rank, grid.y), 1, grid.x_rank, grid.x)
    bias = None if layer.bias is None else layer.bias.detach().clone()        # whole already
    CONVERTED["linear"] += 1
    return Linear2D(grid, local.clone(), bias, grid.y_group, grid.x_group, layer.skip_bias_add, before)


def norm_2d(grid: Grid, norm, config) -> None:
    """The norm module computes over the hidden size sharded on y (its weight stays whole)."""
    rms, hidden, eps = config.normalization == "RMSNorm", config.hidden_size, config.layernorm_epsilon
    shift = 1.0 if config.layernorm_zero_centered_gamma else 0.0

    def forward(x):
        weight = norm.weight + shift if shift else norm.weight
        return grid.norm(x, weight, getattr(norm, "bias", None), eps, rms, hidden)

    norm.forward = forward
    CONVERTED["norm"] += 1


def attention_2d(grid: Grid, att, config) -> None:
    """QKV and proj 2-D; between them q, k, v all-to-all over y (whole sequence, heads/tp each)."""
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    att.linear_qkv = column_2d(grid, att.linear_qkv)
    att.linear_proj = row_2d(grid, att.linear_proj, before=grid.sequence_to_heads)
    megatrons = att.get_query_key_value_tensors

    def get_query_key_value_tensors(hidden_states, key_value_states=None, split_qkv=True, output_gate=False):
        if not split_qkv or output_gate or key_value_states is not None:
            raise NotImplementedError("--tp-2d: self-attention with split q, k, v and no output gate only")
        per_tp = att.num_attention_heads_per_partition, att.num_query_groups_per_partition
        att.num_attention_heads_per_partition, att.num_query_groups_per_partition = heads // grid.x, groups // grid.x
        try:                 # this x-rank's heads, on its sequence chunk
            q, k, v = megatrons(hidden_states, key_value_states, split_qkv=True, output_gate=False)
        finally:
            att.num_attention_heads_per_partition, att.num_query_groups_per_partition = per_tp
        return tuple(grid.heads_to_sequence(t) for t in (q, k, v))

    att.get_query_key_value_tensors = get_query_key_value_tensors
    CONVERTED["attention"] += 1


def convert_layer(grid: Grid, layer, config) -> None:
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    if not isinstance(layer.self_attention, SelfAttention) or not isinstance(layer.mlp, MLP):
        raise NotImplementedError(f"--tp-2d converts Megatron's SelfAttention and dense MLP; this layer has "
                                  f"{type(layer.self_attention).__name__} and {type(layer.mlp).__name__}")
    kinds = [type(m) for m in (layer.self_attention.linear_qkv, layer.mlp.linear_fc1, layer.self_attention.linear_proj,
                               layer.mlp.linear_fc2)]
    if kinds != [ColumnParallelLinear] * 2 + [RowParallelLinear] * 2:     # e.g. a norm fused into the linear
        raise NotImplementedError(f"--tp-2d converts Megatron's local Column/RowParallelLinear; this layer has "
                                  f"{', '.join(k.__name__ for k in kinds)}")
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        if not isinstance(getattr(layer, name), IdentityOp):
            norm_2d(grid, getattr(layer, name), config)
    attention_2d(grid, layer.self_attention, config)
    layer.mlp.linear_fc1 = column_2d(grid, layer.mlp.linear_fc1, gated=config.gated_linear_unit)
    layer.mlp.linear_fc2 = row_2d(grid, layer.mlp.linear_fc2)


class _Grids:
    """The run's grid, made when the first block is built (after Megatron's process groups)."""

    def __init__(self, backend, x: int, y: int):
        self.backend, self.x, self.y, self.made = backend, x, y, None

    def grid(self) -> Grid:
        from megatron.core import parallel_state
        tp_group = parallel_state.get_tensor_model_parallel_group()
        if self.made is not None and self.made.tp_group is tp_group:
            return self.made
        comm, tp = self.backend.comm, self.x * self.y
        world = comm.world_size()
        mine = [comm.global_rank(tp_group, r) for r in range(comm.world_size(tp_group))]
        if mine != list(range(mine[0], mine[0] + tp)) or mine[0] % tp:
            raise RuntimeError(f"--tp-2d expects Megatron's TP groups on consecutive ranks; this one is {mine}")
        groups = [list(range(start, start + tp)) for start in range(0, world, tp)]
        self.made = Grid.build(self.backend, self.x, self.y, groups, tp_group)
        return self.made


def block_init(grids: _Grids):
    def wrap(original):
        def __init__(self, config, *args, **kwargs):
            original(self, config, *args, **kwargs)
            grid = grids.grid()
            for layer in self.layers:
                convert_layer(grid, layer, self.config)
            if getattr(self, "final_layernorm", None) is not None:
                norm_2d(grid, self.final_layernorm, self.config)
            self.tp_2d_grid = grid
        return __init__
    return wrap


def block_forward(original):
    def forward(self, *args, **kwargs):
        grid = self.tp_2d_grid
        if not self.pre_process:                  # the input came from the previous stage (set_input_tensor)
            whole = self.input_tensor
            self.input_tensor = grid.scatter(whole)
        elif "hidden_states" in kwargs:
            kwargs["hidden_states"] = grid.scatter(kwargs["hidden_states"])
        else:
            args = (grid.scatter(args[0]),) + args[1:]
        try:
            out = original(self, *args, **kwargs)
        finally:
            if not self.pre_process:
                self.input_tensor = whole
        return grid.gather(out) if isinstance(out, torch.Tensor) else (grid.gather(out[0]),) + tuple(out[1:])
    return forward


def _split_gate_up(sh_ten, sharded_offsets):
    """A gated fc1 weight sharded on both axes saved as Megatron saves it: its gate rows and its up rows
    as two blocks of the same key (chunk r of 2 x frag and chunk frag + r), the column block kept."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    n = len(sharded_offsets)
    rows, cols = sh_ten.local_shape[0], sh_ten.local_shape[1]
    row_rank, row_frag = sh_ten.global_offset[n] // rows, sh_ten.axis_fragmentations[n]
    col_axis = (n + 1, sh_ten.global_offset[n + 1] // cols, sh_ten.axis_fragmentations[n + 1])

    def build(key, t, replica_id, flattened_range):
        return [ShardedTensor.from_rank_offsets(key, half, *sharded_offsets, (n, row_rank + k * row_frag, 2 * row_frag),
                                                col_axis, replica_id=replica_id, prepend_axis_num=n)
                for k, half in enumerate(torch.chunk(t, 2, 0))]

    def merge(halves):
        with torch.no_grad():
            return torch.cat(halves)

    return ShardedTensorFactory(sh_ten.key, sh_ten.data, build, merge, sh_ten.replica_id,
                                flattened_range=sh_ten.flattened_range)


def swiglu_factory(original):
    def apply_swiglu_sharded_factory(sh_ten, sharded_offsets, singleton_local_shards=False):
        n = len(sharded_offsets)
        if len(sh_ten.local_shape) < 2 or sh_ten.axis_fragmentations[n + 1] == 1:
            return original(sh_ten, sharded_offsets, singleton_local_shards)
        return _split_gate_up(sh_ten, sharded_offsets)
    return apply_swiglu_sharded_factory


def install(patcher, backend, x: int, y: int) -> None:
    why = f"--tp-2d: TP over a {x} x {y} grid (activations [s/{x}, b, h/{y}] between layers)"
    patcher.wrap(f"{BLOCK}.__init__", block_init(_Grids(backend, x, y)), reason=why)
    patcher.wrap(f"{BLOCK}.forward", block_forward, reason=why)
    patcher.wrap(SWIGLU, swiglu_factory, reason="--tp-2d: a gated fc1 weight sharded on both axes, saved as "
                                                "Megatron's gate and up blocks")
