"""`python -m mindspeed plot`: the series read from Megatron-format logs, --log-loss-file lines and
TensorBoard event files, the figure drawn from them, and one-line refusals. (A real training log
and TensorBoard dir are plotted in tests_extend/system/test_pretrain_gpt.py.)"""
import pytest

from mindspeed.__main__ import main as cli
from mindspeed.plotting import figure, plot
from mindspeed.plotting.runs import TOKENS, TRAIN, VALID, read_run, run_names

LOG = """\
> MindSpeed backend: torch (device cpu)
[default0]: [2026-11-23 10:00:00] iteration        1/      20 | consumed samples:  4 | elapsed time per iteration (ms): 30.1 | learning rate: 1.0E-03 | global batch size:     4 | lm loss: 5.571702E+00 | grad norm: 4.050 | tokens per second: 1234 | peak memory (MB): 1 |
 [2026-11-23 10:00:01] iteration       10/      20 | consumed samples: 40 | elapsed time per iteration (ms): 29.0 | throughput per device (TFLOP/s/device): 0.001 | MFU: 3.1% | learning rate: 1.0E-03 | global batch size:     4 | lm loss: 4.342623E+00 | grad norm: 0.501 | tokens per second: 1300 | peak memory (MB): 1 |
 validation loss at iteration 10 | lm loss value: 4.216660E+00 | lm loss PPL: 6.8E+01 |
 validation loss at iteration 10 on test set | lm loss value: 9.9E+00 | lm loss PPL: 2.0E+04 |
 final validation loss at iteration 20 | lm loss value: 3.216660E+00 | lm loss PPL: 2.494467E+01 |
"""


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "run-a.log"
    path.write_text(LOG)
    return path


def test_megatron_log_lines_give_train_validation_and_tokens(log):
    run = read_run(str(log))
    assert run.name == "run-a"
    assert run.points(TRAIN) == ([1, 10], [5.571702, 4.342623])
    assert run.points(VALID) == ([10, 20], [4.21666, 3.21666])        # the test-set line is not validation
    assert run.points(TOKENS) == ([1, 10], [1234.0, 1300.0])


def test_loss_file_and_tensorboard_dir(tmp_path):
    loss_file = tmp_path / "losses.jsonl"
    loss_file.write_text('{"iteration": 1, "lm_loss": 5.25}\n{"iteration": 2, "lm_loss": 4.5}\n')
    assert read_run(str(loss_file)).points(TRAIN) == ([1, 2], [5.25, 4.5])
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(str(tmp_path / "tb"))
    for it, loss in ((1, 5.5), (2, 4.75)):
        writer.add_scalar("lm loss", loss, it)
        writer.add_scalar("tokens-per-second", 100.0 * it, it)
    writer.add_scalar("lm loss validation", 4.5, 2)
    writer.add_scalar("lm loss final validation", 4.25, 3)
    writer.add_scalar("grad-norm", 1.0, 2)                            # not plotted
    writer.close()
    run = read_run(str(tmp_path / "tb"))
    assert (run.points(TRAIN), run.points(VALID), run.points(TOKENS)) == \
        (([1, 2], [5.5, 4.75]), ([2, 3], [4.5, 4.25]), ([1, 2], [100.0, 200.0]))


def test_runs_with_the_same_file_name_are_told_apart_by_their_directory():
    assert run_names(["/x/a/train.log", "/x/b/train.log", "/x/c/other.log"]) == ["a/train", "b/train", "other"]


def test_figure_has_each_runs_series_and_a_throughput_panel(log, tmp_path):
    other = tmp_path / "b" / "run-b.log"
    other.parent.mkdir()
    other.write_text(LOG.replace("lm loss: 5.571702E+00", "lm loss: 6.0E+00"))
    fig = figure.draw([read_run(str(log)), read_run(str(other))])
    loss_ax, tokens_ax = fig.axes
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in loss_ax.get_lines()}
    assert lines == {"run-a train": ([1, 10], [5.571702, 4.342623]), "run-a validation": ([10, 20], [4.21666, 3.21666]),
                     "run-b train": ([1, 10], [6.0, 4.342623]), "run-b validation": ([10, 20], [4.21666, 3.21666])}
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == list(lines)
    assert {line.get_label(): list(line.get_ydata()) for line in tokens_ax.get_lines()} == \
        {"run-a": [1234.0, 1300.0], "run-b": [1234.0, 1300.0]}
    assert tokens_ax.get_xlabel() == "iteration"
    figure.save(fig, str(tmp_path / "out.png"))


def test_plot_writes_a_png_and_without_tokens_there_is_one_panel(tmp_path):
    loss_file = tmp_path / "losses.jsonl"
    loss_file.write_text('{"iteration": 1, "lm_loss": 5.25}\n')
    out = tmp_path / "loss.png"
    assert plot([str(loss_file)], str(out)) == {"losses": {TRAIN: 1, VALID: 0, TOKENS: 0}}
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(figure.draw([read_run(str(loss_file))]).axes) == 1


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("no loss here\n iteration 3/ 9 | lm loss value: x |\n", "has no loss values (expected Megatron-format"),
])
def test_a_bad_path_is_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "bad.log"
    if content is not None:
        path.write_text(content)
    assert cli(["plot", str(path), "-o", str(tmp_path / "x.png")]) == 2      # python -m mindspeed plot ...
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path} ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "x.png").exists()
