"""The comparison with upstream's MindSpore support list (docs/mindspore.md's generated table):
each row names upstream's flag as its master spells it (or the older branch that alone has it),
the features here that do the work, and what the support matrix says of them."""
import os

from mindspeed import upstream_mindspore as upstream
from mindspeed.features.registry import all_features
from mindspeed.flags.mindspeed_flags import trainer_parser

BY_ID = {f.id: f for f in all_features()}
ROWS = {row.row: row for row in upstream.UNSUPPORTED_UPSTREAM}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KNOWN_FLAGS = {name for action in trainer_parser()._actions for name in action.option_strings}


def test_every_row_names_features_that_exist_and_flags_that_parse_here_or_an_older_branch():
    for row in upstream.UNSUPPORTED_UPSTREAM:
        assert all(i in BY_ID for i in row.ids), row
        first = row.flags.split()[0] if row.flags else ""
        if row.ids:      # a feature here takes upstream's flag, so an upstream script gets its answer
            assert first in KNOWN_FLAGS and not row.branch, row
        elif row.branch:
            assert first and "only" in row.branch and first not in KNOWN_FLAGS, row


def test_pipe_experts_is_mlp_communication_hiding_and_the_degree_is_an_old_branch_flag():
    assert ROWS["MLP communication hiding"].ids == ("pipe-experts",)
    assert "--use-pipe-experts" in [fl.name for fl in BY_ID["pipe-experts"].flags]
    degree = ROWS["experts pipeline degree"]
    assert (degree.flags, degree.ids, degree.branch) == ("--moe-experts-pipeline-degree", (), "upstream branch core_r0.8.0 only")
    for name in ("hierarchical alltoallv", "auto tuning", "memory fragmentation optimization"):
        assert ROWS[name].branch and not ROWS[name].ids, name


def test_mask_unification_is_always_on_as_docs_memory_says():
    row = ROWS["mask unification (one shared causal mask)"]
    for backend, device in upstream.COLUMNS:
        assert upstream.cell(row, BY_ID, backend, device).startswith("always on"), (backend, device)
    with open(os.path.join(ROOT, "docs", "memory.md"), encoding="utf-8") as fh:
        assert 'Shared causal mask ("mask unification", always on, no flag' in fh.read()
    assert upstream.runs_on_mindspore_cpu(row, BY_ID)


def test_cells_say_refused_by_design_not_implemented_yet_or_the_matrix_level():
    table = upstream.table()
    assert "| nano-pipe | `--use-nanopipe` | nanopipe | refused by design |" in table
    assert "| MLP communication hiding | `--use-pipe-experts` | pipe-experts | refused by design |" in table
    assert "| experts pipeline degree | `--moe-experts-pipeline-degree` (upstream branch core_r0.8.0 only) | — " \
           "| not in MindSpeed |" in table
    assert "| automated pipeline | `--automated-pipeline` | automated-pipeline | not implemented yet |" in table
    assert "| swap attention | `--swap-attention --swap-modules` | swap-attention | emulated |" in table
