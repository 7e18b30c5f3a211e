"""mindspeed.errors: the one-line reports every entry point prints."""
import pytest

from mindspeed.errors import ArgumentError, one_line, positive_int, report


class _Writes:
    def __init__(self):
        self.calls = []

    def write(self, text):
        self.calls.append(text)

    def flush(self):
        pass


def test_a_report_is_one_write_ending_in_a_newline():
    # Ranks share stderr: the text and its newline written apart let another rank's line in between.
    stream = _Writes()
    report(ValueError("saving failed on rank 1"), stream=stream)
    assert stream.calls == ["error: saving failed on rank 1\n"]


def test_a_report_keeps_the_prefix_it_is_given():
    stream = _Writes()
    report("bad flag", prefix="convert: error: ", stream=stream)
    assert stream.calls == ["convert: error: bad flag\n"]


def test_one_line_folds_breaks_and_cuts():
    assert one_line("a\n  b\tc") == "a b c"
    assert one_line("x" * 20, limit=10) == "xxxxxxx..."


@pytest.mark.parametrize("entry, argv", [
    ("generate", ["--load", "d", "--tokenizer-model", "t", "--max-new-tokens"]),
    ("convert", ["--load-model-type", "hf", "--save-model-type", "mg", "--load-dir", "a", "--save-dir", "b",
                 "--target-tensor-parallel-size"]),
])
@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_both_entry_points_refuse_a_count_below_one_saying_so(entry, argv, value, capsys):
    # one argparse type for both: its message reaches the user (not argparse's "invalid ... value")
    if entry == "generate":
        from mindspeed.generate.cli import build_parser
        with pytest.raises(ArgumentError, match=f"'{value}' is not a positive integer"):
            build_parser().parse_args(argv + [value])
    else:
        from mindspeed.convert.cli import build_parser
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv + [value])
        assert f"'{value}' is not a positive integer" in capsys.readouterr().err


def test_positive_int_takes_a_count():
    assert positive_int("3") == 3
