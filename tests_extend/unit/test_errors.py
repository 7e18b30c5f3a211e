"""mindspeed.errors: the one-line reports every entry point prints."""
from mindspeed.errors import one_line, report


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
