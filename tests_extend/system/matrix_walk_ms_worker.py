"""msrun worker for tests_extend/system/test_matrix_walk.py: the accepted mindspore/cpu cells,
started in turn through the trainer's entry point. Usage: msrun ... matrix_walk_ms_worker.py CELLS OUT_DIR
(CELLS: a JSON list of [feature id, argv])."""
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests_extend.distributed.msrun_helper import end_worker, write_result  # noqa: E402
from tests_extend.system import matrix_walk as walk  # noqa: E402


def main(cells_file: str, out_dir: str) -> None:
    rank = int(os.environ.get("RANK_ID", os.environ.get("RANK", "0")))
    with open(cells_file) as f:
        cells = json.load(f)
    results = {}
    try:
        for name, argv in cells:
            results[name] = walk.start(argv, os.path.join(out_dir, f"{name.replace('/', '-')}.{rank}.jsonl"))
        write_result(out_dir, rank, results)
    except Exception:
        write_result(out_dir, rank, {"worker": {"trained": False, "error": traceback.format_exc()}})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    end_worker()
