"""Context-parallel test bodies shared by the torch and mindspore backends.

A body builds the same global q/k/v/mask on every rank (numpy, seeded), runs single-process
attention on the whole sequence, then this rank's shard through the CP feature, and checks
output and q/k/v gradients at this rank's positions. Only `kit` (tensor creation and autograd,
one per framework) differs between backends; the feature code and the checks are the same.
"""
from __future__ import annotations

import contextlib
import zlib

import numpy as np

from mindspeed.backends import get_backend
from mindspeed.features.context_parallel import build_cp_groups, context_parallel_attention, local_positions

# (rtol, atol) per dtype; bf16 from docs/kernels.md (CP attention vs single device; GQA looser)
TOLERANCE = {"float32": (1e-5, 2e-5), "bfloat16": (2.5e-2, 2.5e-2), "bfloat16-gqa": (3.5e-2, 3.5e-2)}


def make_case(seed, b=2, s=16, n=4, nkv=4, d=8, mask_type="causal"):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((s, b, n * d)).astype(np.float32)
    k = rng.standard_normal((s, b, nkv * d)).astype(np.float32)
    v = rng.standard_normal((s, b, nkv * d)).astype(np.float32)
    dout = rng.standard_normal((s, b, n * d)).astype(np.float32)
    mask = None
    if mask_type == "general":   # a random pattern (not causal), the diagonal always visible
        mask = rng.random((b, 1, s, s)) < 0.4
        mask[..., np.arange(s), np.arange(s)] = False
    return dict(q=q, k=k, v=v, dout=dout, mask=mask, n=n)


def check_case(kit, cp, case, dtype="float32", tol_key=None):
    """Returns the max abs error of (out, dq, dk, dv) after asserting closeness."""
    kernels = get_backend().kernels
    s = case["q"].shape[0]
    causal = case["mask"] is None
    mask = None if causal else kit.tensor(case["mask"], "bool")
    full = [kit.tensor(case[x], dtype) for x in ("q", "k", "v")]

    def single(q, k, v):
        return kernels.attention(q, k, v, layout="SBH", head_num=case["n"], causal=causal, mask=mask)[0]

    ref_out, ref_grads = kit.run_with_grads(single, full, kit.tensor(case["dout"], dtype))
    pos = local_positions(s, cp.algo, cp.size, cp.rank, cp.ulysses_degree)
    local = [kit.tensor(case[x][pos], dtype) for x in ("q", "k", "v")]

    def sharded(q, k, v):
        return context_parallel_attention(q, k, v, cp, head_num=case["n"], causal=causal, mask=mask)

    out, grads = kit.run_with_grads(sharded, local, kit.tensor(case["dout"][pos], dtype))
    rtol, atol = TOLERANCE[tol_key or dtype]
    errors = []
    for name, got, want in zip(("out", "dq", "dk", "dv"), [out] + grads, [ref_out] + ref_grads):
        want = want[pos]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol,
                                   err_msg=f"{name} differs ({cp.algo}, rank {cp.rank}, {dtype})")
        errors.append(float(np.abs(got - want).max()))
    return errors


def cases_for(cp_size):
    """(label, algo, options) per CP configuration exercised at this world size."""
    configs = [("ulysses", "ulysses_cp_algo", {}),
               ("ring", "megatron_cp_algo", {}),
               ("ring-overlap", "megatron_cp_algo", {"overlap": True}),
               ("kvallgather", "kvallgather_cp_algo", {})]
    if cp_size == 2:      # --use-fused-ring-attention-update: the backend's fused merge of the ring steps
        configs += [("ring-fused", "megatron_cp_algo", {"fused_merge": True})]
    if cp_size == 4:
        configs += [("double-ring", "megatron_cp_algo", {"window_size": 2, "overlap": True}),
                    ("hybrid", "hybrid_cp_algo", {"ulysses_degree": 2}),
                    ("hybrid-window", "hybrid_cp_algo", {"ulysses_degree": 2, "window_size": 2})]
    return configs


def cp_subgroups(world_size, cp_size):
    """(this rank's CP group, every CP group's ranks): consecutive blocks of cp_size ranks (the
    world itself when they are equal); every rank creates every group, in the same order."""
    if cp_size == world_size:
        return None, None
    comm = get_backend().comm
    blocks = [list(range(s, s + cp_size)) for s in range(0, world_size, cp_size)]
    groups = [comm.new_group(b) for b in blocks]
    return groups[comm.rank() // cp_size], blocks


def arrangement(cp) -> str:
    """What build_cp_groups actually built: 'u<Ulysses group size>xr<ring group size>w<window>'
    (sizes measured on the groups themselves; 'ag<CP group size>' for the KV all-gather), so a hybrid that quietly fell back to a plain ring
    (u1) or to plain Ulysses (r1) is seen."""
    comm = get_backend().comm
    if cp.algo == "kvallgather_cp_algo":      # no Ulysses or ring part: K/V all-gathered over the CP group
        return f"ag{comm.world_size(cp.group)}"
    uly = comm.world_size(cp.ulysses_group) if cp.ulysses_degree > 1 else 1
    ring = comm.world_size(cp.ring_group) if cp.ring_size > 1 else 1
    assert uly * ring == cp.size, (cp.algo, uly, ring, cp.size)
    return f"u{uly}xr{ring}w{cp.window_size}"


# the arrangement each case must build (cases_for), by CP size
ARRANGEMENTS = {2: {"ulysses": "u2xr1w1", "ring": "u1xr2w1", "ring-overlap": "u1xr2w1", "ring-fused": "u1xr2w1",
                    "kvallgather": "ag2"},
                4: {"ulysses": "u4xr1w1", "ring": "u1xr4w1", "ring-overlap": "u1xr4w1", "double-ring": "u1xr4w2",
                    "hybrid": "u2xr2w1", "hybrid-window": "u2xr2w2", "kvallgather": "ag4"}}


def run_all(kit, world_size, dtypes=("float32", "bfloat16"), cp_size=None, labels=None):
    """Every algorithm (or those in `labels`) x {causal, general} x {MHA, GQA} x dtypes on CP
    groups of cp_size ranks (default: the world); returns {label/case: max error} plus
    {label/arrangement: what was built} and {label/fused_merges: calls of the backend's fused
    ring_attention_update}."""
    cp_size = cp_size or world_size
    group, blocks = cp_subgroups(world_size, cp_size)
    results = {}
    for label, algo, options in cases_for(cp_size):
        if labels is not None and label not in labels:
            continue
        cp = build_cp_groups(algo, backend=get_backend(), group=group, all_cp_ranks=blocks, **options)
        results[f"cp{cp_size}/{label}/arrangement"] = arrangement(cp)
        with counted_fused_merges() as calls:
            _run_cases(kit, cp, cp_size, label, dtypes, results)
        results[f"cp{cp_size}/{label}/fused_merges"] = None if calls is None else len(calls)
    return results


@contextlib.contextmanager
def counted_fused_merges():
    """The list of calls the backend's fused ring_attention_update gets meanwhile (the real kernel runs);
    None where the device serves the reference for it (nothing to tell apart)."""
    kernels, calls = get_backend().kernels, []
    if kernels.reference is kernels:
        yield None
        return
    fused = kernels._impl["ring_attention_update"]

    def counted(*args, **kwargs):
        calls.append(1)
        return fused(*args, **kwargs)
    kernels._impl["ring_attention_update"] = counted
    try:
        yield calls
    finally:
        kernels._impl["ring_attention_update"] = fused


def _run_cases(kit, cp, cp_size, label, dtypes, results):
    for mask_type in ("causal", "general"):
        for nkv in (4, 2 if cp_size == 2 else 1):
            for dtype in dtypes:
                case = make_case(seed=zlib.crc32(f"{label}/{mask_type}/{nkv}".encode()), nkv=nkv,
                                 mask_type=mask_type)
                tol = "bfloat16-gqa" if dtype == "bfloat16" and nkv < 4 else dtype
                errs = check_case(kit, cp, case, dtype, tol)
                results[f"cp{cp_size}/{label}/{mask_type}/nkv{nkv}/{dtype}"] = max(errs)


# packed documents (EOD reset) per sample over s = 16 tokens: ends inside chunks and on chunk
# borders, a one-token document, and a sample that is a single document
DOCUMENT_ENDS = [[3, 8, 9, 13, 16], [16]]


def document_mask(ends, s):
    """The dense reference: causal inside each document (True = masked), [b, 1, s, s]."""
    mask = np.ones((len(ends), 1, s, s), dtype=bool)
    for i, row in enumerate(ends):
        for a, b in zip([0] + row[:-1], row):
            mask[i, 0, a:b, a:b] = ~np.tril(np.ones((b - a, b - a), dtype=bool))
    return mask


def check_documents(kit, cp, seed, nkv=4):
    """CP attention given the documents' ends (no mask) against single-process attention with the
    dense per-document mask; returns the max abs error of (out, dq, dk, dv)."""
    case = make_case(seed, nkv=nkv)
    case["mask"] = document_mask(DOCUMENT_ENDS, case["q"].shape[0])
    kernels = get_backend().kernels
    s = case["q"].shape[0]
    mask = kit.tensor(case["mask"], "bool")
    full = [kit.tensor(case[x], "float32") for x in ("q", "k", "v")]
    ref_out, ref_grads = kit.run_with_grads(
        lambda q, k, v: kernels.attention(q, k, v, layout="SBH", head_num=case["n"], mask=mask)[0],
        full, kit.tensor(case["dout"], "float32"))
    pos = local_positions(s, cp.algo, cp.size, cp.rank, cp.ulysses_degree)
    out, grads = kit.run_with_grads(
        lambda q, k, v: context_parallel_attention(q, k, v, cp, head_num=case["n"], documents=DOCUMENT_ENDS),
        [kit.tensor(case[x][pos], "float32") for x in ("q", "k", "v")], kit.tensor(case["dout"][pos], "float32"))
    rtol, atol = TOLERANCE["float32"]
    errors = []
    for name, got, want in zip(("out", "dq", "dk", "dv"), [out] + grads, [ref_out] + ref_grads):
        np.testing.assert_allclose(got, want[pos], rtol=rtol, atol=atol,
                                   err_msg=f"{name} differs with documents ({cp.algo}, rank {cp.rank})")
        errors.append(float(np.abs(got - want[pos]).max()))
    return max(errors)


def document_cases_for(cp_size):
    """cases_for's, plus at CP 2 the KV all-gather with the fused merge (only its document parts merge)."""
    extra = [("kvallgather-fused", "kvallgather_cp_algo", {"fused_merge": True})] if cp_size == 2 else []
    return cases_for(cp_size) + extra


def run_documents(world_size, cp_size=None):
    """Every algorithm with packed documents (MHA and GQA), fp32: {label/documents/nkvN: max error}
    and {label/documents/fused_merges: calls of the backend's fused ring_attention_update}."""
    cp_size = cp_size or world_size
    group, blocks = cp_subgroups(world_size, cp_size)
    results = {}
    from tests_extend.distributed import torch_kit
    for label, algo, options in document_cases_for(cp_size):
        cp = build_cp_groups(algo, backend=get_backend(), group=group, all_cp_ranks=blocks, **options)
        with counted_fused_merges() as calls:
            for nkv in (4, 2 if cp_size == 2 else 1):
                seed = zlib.crc32(f"{label}/documents/{nkv}".encode())
                results[f"cp{cp_size}/{label}/documents/nkv{nkv}"] = check_documents(torch_kit, cp, seed, nkv)
        results[f"cp{cp_size}/{label}/documents/fused_merges"] = None if calls is None else len(calls)
    return results
