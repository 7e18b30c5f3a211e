"""Context parallelism on the torch backend in one 4-process gloo job: CP groups of 4 (the world)
and of 2 (two groups side by side, as with data parallelism). For every algorithm, output and
q/k/v gradients equal single-process attention on the whole sequence (causal and general masks,
MHA and GQA, fp32 and bf16; packed documents given by their ends, against the dense per-document
mask, fp32; the KV all-gather's document parts merged by the fused kernel when asked). At CP 4: hybrid is Ulysses 2 x ring 2 (with and without a window),
and the double ring has two inner rings of 2; the groups actually built are checked."""
import pytest

from tests_extend.distributed import cp_cases
from tests_extend.distributed.harness import run_distributed


def _body(rank, world_size):
    import torch
    torch.set_num_threads(1)      # 4 processes share 2 cores
    from tests_extend.distributed import torch_kit
    results = cp_cases.run_all(torch_kit, world_size, cp_size=4)
    results.update(cp_cases.run_all(torch_kit, world_size, cp_size=2))
    docs = cp_cases.run_documents(world_size, cp_size=4)
    docs.update(cp_cases.run_documents(world_size, cp_size=2))
    return results, docs


@pytest.mark.cpu_numerics
def test_cp_attention_matches_single_process():
    results = run_distributed(_body, world_size=4, timeout=300)
    expected = {f"cp{size}/{label}" for size in (2, 4) for label, _, _ in cp_cases.cases_for(size)}
    for per_rank, docs in results:
        # packed documents (EOD reset): every algorithm, given the documents' ends and no mask
        doc_merges = {k.split("/documents/")[0]: docs.pop(k) for k in list(docs) if k.endswith("/fused_merges")}
        assert set(docs) == {f"cp{size}/{label}/documents/nkv{nkv}" for size in (2, 4)
                             for label, _, _ in cp_cases.document_cases_for(size) for nkv in (4, 2 if size == 2 else 1)}
        # the document parts merge with the fused kernel where the feature asks for it, the KV all-gather's too
        assert doc_merges.pop("cp2/ring-fused") > 0 and doc_merges.pop("cp2/kvallgather-fused") > 0, doc_merges
        assert set(doc_merges.values()) == {0}, doc_merges
        errors = {k: v for k, v in per_rank.items() if not k.endswith(("/arrangement", "/fused_merges"))}
        # the ring merges its steps with the fused kernel exactly where the feature asks for it
        merges = {k.rsplit("/", 1)[0]: v for k, v in per_rank.items() if k.endswith("/fused_merges")}
        assert merges.pop("cp2/ring-fused") > 0 and set(merges.values()) == {0}, merges
        assert {"/".join(k.split("/")[:2]) for k in errors} == expected
        assert len(errors) == 8 * len(expected)        # 2 masks x 2 kv-head counts x 2 dtypes
        # hybrid is Ulysses 2 x ring 2 (not a degenerate u1 ring), the double ring has inner rings of 2
        built = {k.rsplit("/", 1)[0]: v for k, v in per_rank.items() if k.endswith("/arrangement")}
        assert built == {f"cp{size}/{label}": want for size, table in cp_cases.ARRANGEMENTS.items()
                         for label, want in table.items()}
