import sys
import warnings

# Megatron warns at import about Apex / Transformer Engine, which generation never uses: a refusal
# stays one line
for _category in (UserWarning, FutureWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", category=_category)

from mindspeed import deferred_compile  # noqa: E402
from mindspeed.patching import GLOBAL_PATCHES  # noqa: E402

deferred_compile.install(GLOBAL_PATCHES)   # before the cli imports Megatron-Core: ~4 s of each rank's start

from mindspeed.generate.cli import main  # noqa: E402  (after the filters and the install)

if __name__ == "__main__":
    sys.exit(main())
