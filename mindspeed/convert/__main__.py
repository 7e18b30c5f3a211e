import sys

from mindspeed.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m mindspeed.convert"))
