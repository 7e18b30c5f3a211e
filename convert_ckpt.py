"""Checkpoint conversion, as Megatron-LM / MindSpeed-LLM users call it: see mindspeed/convert/."""
import sys

from mindspeed.convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
