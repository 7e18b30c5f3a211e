import sys
import warnings

# Megatron warns at import about Apex / Transformer Engine, which evaluation never uses: a refusal
# stays one line
for _category in (UserWarning, FutureWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", category=_category)

from mindspeed.evaluate.cli import main  # noqa: E402  (after the filters)

if __name__ == "__main__":
    sys.exit(main())
