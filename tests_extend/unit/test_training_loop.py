"""The shared outer training loop (mindspeed/training/loop.py) driven by a fake framework's parts:
plain Python, no torch or MindSpore. What it counts, when it evaluates and saves, the events it publishes,
the log lines and the summary."""
import dataclasses
import os
import re
import signal
import time

import pytest

from mindspeed.features.base import TRAIN_END, TRAIN_STEP_BEGIN, TRAIN_STEP_END
from mindspeed.training import loop
from mindspeed.flags.trainer_flags import parse_args
from mindspeed.training.logger import TrainingLogger

GBS = 8


class FakeFramework:
    """Records every call the loop makes, in order, in `events`."""

    def __init__(self, monkeypatch, skip_at=(), batch_sizes=None, valid_loss=2.5, signal_at=None, other_rank_at=None):
        self.events, self.skip_at, self.valid_loss = [], set(skip_at), valid_loss
        self.batch_sizes = batch_sizes or {}          # consumed samples -> that step's batch size
        self.lr_asked = []
        self.signal_at = signal_at            # this process signals itself during that step
        self.other_rank_at = other_rank_at    # from that step on, another rank votes to exit
        self.votes = []                       # (iteration, this rank's vote) per any_rank call

    def publish(self, event, **info):
        self.events.append((event, info["iteration"]))

    def parts(self, loss_scale=False) -> loop.TrainParts:
        return loop.TrainParts(step=self.step, evaluate=self.evaluate, save=self.save, lr=self.lr,
                               peak_memory_mb=lambda: 1.0, batch_size=lambda c: self.batch_sizes.get(c, GBS),
                               loss_scale=(lambda: 1024.0) if loss_scale else None, any_rank=self.any_rank)

    def any_rank(self, flag):
        iteration = self.of("step")[-1][0]
        self.votes.append((iteration, flag))
        return flag or (self.other_rank_at is not None and iteration >= self.other_rank_at)

    def step(self, iteration, consumed, batch_size):
        self.events.append(("step", iteration, consumed, batch_size))
        if iteration == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        applied = iteration not in self.skip_at
        return loop.StepResult(loss=10.0 / iteration, grad_norm=1.0 if applied else None, applied=applied)

    def evaluate(self):
        self.events.append(("evaluate",))
        return self.valid_loss

    def save(self, iteration, consumed):
        self.events.append(("save", iteration, consumed))

    def lr(self, iteration):
        self.lr_asked.append(iteration)
        return 1e-3

    def of(self, kind):
        return [e[1:] for e in self.events if e[0] == kind]

    def evaluated_after(self):
        """The iteration of the step each evaluation followed (the final one follows TRAIN_END)."""
        last, seen = None, []
        for event in self.events:
            if event[0] in ("step", TRAIN_END):
                last = event[1] if event[0] == "step" else ("end", event[1])
            elif event[0] == "evaluate":
                seen.append(last)
        return seen


def _args(*argv):
    return parse_args(["--global-batch-size", str(GBS), "--micro-batch-size", "4", "--seq-length", "16",
                       "--log-interval", "1", *argv])


def _report(args, **kw):
    keys = kw.pop("summary_keys", ("iteration", "final_valid_loss", "tokens_per_s", "parameters", "losses"))
    return loop.RunReport(parameters=123, summary_keys=keys, device="cpu", write_loss_file=False, **kw)


def _run(fake, args, start=None, **kw):
    return loop.train(args, TrainingLogger(args, is_writer=True), fake.parts(), _report(args, **kw),
                      start or loop.Progress(), publish=fake.publish)


def test_a_fresh_run_steps_every_iteration_and_counts_consumed_samples(monkeypatch, capsys):
    fake = FakeFramework(monkeypatch)
    summary = _run(fake, _args("--train-iters", "5"))
    assert fake.of("step") == [(i, GBS * (i - 1), GBS) for i in range(1, 6)]
    assert summary["iteration"] == 5 and summary["losses"] == [10.0 / i for i in range(1, 6)]
    out = capsys.readouterr().out
    assert "> training from iteration 0 to 5" in out
    assert re.findall(r"iteration +(\d+)/ +5 \| consumed samples: +(\d+)", out) == \
        [(str(i), str(GBS * i)) for i in range(1, 6)]
    assert fake.lr_asked == [1, 2, 3, 4, 5]        # the lr after each step, read where it is logged


def test_a_resumed_run_starts_after_the_loaded_iteration_and_stops_at_exit_interval(monkeypatch, capsys):
    fake = FakeFramework(monkeypatch)
    summary = _run(fake, _args("--train-iters", "10", "--exit-interval", "8"), loop.Progress(6, 6 * GBS))
    assert fake.of("step") == [(7, 6 * GBS, GBS), (8, 7 * GBS, GBS)]
    assert summary["iteration"] == 8
    out = capsys.readouterr().out
    assert "> training from iteration 6 to 8" in out
    assert "> done: 8 iterations | final validation loss 2.5000 | throughput" in out


def test_exit_interval_past_train_iters_stops_at_train_iters(monkeypatch):
    fake = FakeFramework(monkeypatch)
    assert _run(fake, _args("--train-iters", "3", "--exit-interval", "5"))["iteration"] == 3
    assert [s[0] for s in fake.of("step")] == [1, 2, 3]


def test_evaluation_every_interval_but_not_at_the_last_iteration_then_a_final_one(monkeypatch, capsys):
    fake = FakeFramework(monkeypatch)
    _run(fake, _args("--train-iters", "9", "--eval-interval", "3"))
    assert fake.evaluated_after() == [3, 6, ("end", 9)]
    out = capsys.readouterr().out
    assert re.findall(r" (validation|final validation) loss at iteration (\d+)", out) == \
        [("validation", "3"), ("validation", "6"), ("final validation", "9")]


def test_evaluation_interval_counts_from_zero_not_from_the_resumed_iteration(monkeypatch):
    fake = FakeFramework(monkeypatch)
    _run(fake, _args("--train-iters", "12", "--eval-interval", "4"), loop.Progress(5, 5 * GBS))
    assert fake.evaluated_after() == [8, ("end", 12)]


def test_no_validation_data_logs_no_validation_and_reports_none(monkeypatch, capsys):
    fake = FakeFramework(monkeypatch, valid_loss=None)
    summary = _run(fake, _args("--train-iters", "4", "--eval-interval", "2"))
    assert summary["final_valid_loss"] is None
    out = capsys.readouterr().out
    assert "validation loss at" not in out and "final validation loss n/a |" in out


def test_saves_at_the_interval_and_once_more_at_the_end(monkeypatch, capsys, tmp_path):
    fake = FakeFramework(monkeypatch)
    _run(fake, _args("--train-iters", "10", "--save", str(tmp_path), "--save-interval", "4"))
    assert fake.of("save") == [(4, 4 * GBS), (8, 8 * GBS), (10, 10 * GBS)]
    saved = re.findall(r"> saved checkpoint at iteration (\d+) to (\S+)", capsys.readouterr().out)
    assert saved == [("4", str(tmp_path)), ("8", str(tmp_path)), ("10", str(tmp_path))]


def test_the_last_iteration_saved_by_the_interval_is_not_saved_twice(monkeypatch, tmp_path):
    fake = FakeFramework(monkeypatch)
    _run(fake, _args("--train-iters", "10", "--exit-interval", "6", "--save", str(tmp_path), "--save-interval", "3"))
    assert fake.of("save") == [(3, 3 * GBS), (6, 6 * GBS)]


def test_without_save_interval_only_the_final_save_and_without_save_none(monkeypatch, tmp_path):
    fake = FakeFramework(monkeypatch)
    _run(fake, _args("--train-iters", "5", "--save", str(tmp_path)))
    assert fake.of("save") == [(5, 5 * GBS)]
    fake = FakeFramework(monkeypatch)
    _run(fake, _args("--train-iters", "5", "--save-interval", "2"))
    assert fake.of("save") == []


def test_a_run_resumed_at_its_end_takes_no_step_but_saves_and_validates(monkeypatch, tmp_path):
    fake = FakeFramework(monkeypatch)
    summary = _run(fake, _args("--train-iters", "4", "--save", str(tmp_path), "--save-interval", "2"),
                   loop.Progress(4, 4 * GBS))
    assert fake.of("step") == [] and fake.of("save") == [(4, 4 * GBS)] and fake.evaluated_after() == [("end", 4)]
    assert summary["iteration"] == 4 and summary["losses"] == []


def test_hooks_fire_around_each_step_and_at_the_end_before_the_final_save(monkeypatch, tmp_path):
    fake = FakeFramework(monkeypatch)
    _run(fake, _args("--train-iters", "4", "--eval-interval", "2", "--save", str(tmp_path), "--save-interval", "3"),
         loop.Progress(1, GBS))
    begin, end, done = TRAIN_STEP_BEGIN, TRAIN_STEP_END, TRAIN_END
    assert [e[:2] for e in fake.events] == [
        (begin, 2), ("step", 2), (end, 2), ("evaluate",),
        (begin, 3), ("step", 3), (end, 3), ("save", 3),
        (begin, 4), ("step", 4), (end, 4),
        (done, 4), ("save", 4), ("evaluate",)]


def test_batch_size_ramp_up_sizes_each_step_and_its_consumed_samples(monkeypatch, capsys):
    fake = FakeFramework(monkeypatch, batch_sizes={0: 4, 4: 4, 8: 8})
    args = _args("--train-iters", "4", "--rampup-batch-size", "4", "4", "8")
    _run(fake, args)
    assert fake.of("step") == [(1, 0, 4), (2, 4, 4), (3, 8, 8), (4, 16, 8)]
    out = capsys.readouterr().out
    assert "> global batch size ramps up from 4 by 4 over 8 samples to 8" in out
    assert re.findall(r"consumed samples: +(\d+) .* global batch size: +(\d+)", out) == \
        [("4", "4"), ("8", "4"), ("16", "8"), ("24", "8")]


def test_skipped_updates_are_counted_from_the_resumed_count(monkeypatch, capsys):
    fake = FakeFramework(monkeypatch, skip_at={3, 5})
    loop.train(_args("--train-iters", "6"), TrainingLogger(_args("--train-iters", "6"), is_writer=True),
               fake.parts(loss_scale=True), _report(_args()), loop.Progress(1, GBS, skipped=2),
               publish=fake.publish)
    out = capsys.readouterr().out
    assert re.findall(r"number of skipped iterations: +(\d+)", out) == ["2", "3", "3", "4", "4"]
    assert re.findall(r"grad norm: (\S+)", out) == ["1.000", "n/a", "1.000", "n/a", "1.000"]
    assert out.count("loss scale: 1024.0") == 5


def test_the_summary_has_the_trainers_keys_in_its_order_and_the_done_line_its_baseline(monkeypatch, capsys):
    fake = FakeFramework(monkeypatch)
    torch_keys = ("iteration", "final_valid_loss", "unigram_baseline", "tokens_per_s", "parameters")
    summary = _run(fake, _args("--train-iters", "3"), summary_keys=torch_keys, unigram_baseline=2.75)
    assert tuple(summary) == torch_keys
    assert summary["iteration"] == 3 and summary["final_valid_loss"] == 2.5
    assert summary["unigram_baseline"] == 2.75 and summary["parameters"] == 123 and summary["tokens_per_s"] > 0
    assert re.search(r"^> done: 3 iterations \| final validation loss 2\.5000 \(unigram baseline 2\.7500\) \| "
                     r"throughput \d+ tokens/s$", capsys.readouterr().out, re.M)
    ms_keys = ("iteration", "final_valid_loss", "tokens_per_s", "parameters", "losses", "step_time_s")
    summary = _run(FakeFramework(monkeypatch), _args("--train-iters", "3"), summary_keys=ms_keys)
    assert tuple(summary) == ms_keys and summary["losses"] == [10.0, 5.0, 10.0 / 3]
    assert summary["step_time_s"] is not None   # steps 2 and 3 (the first one's setup time is left out)
    assert re.search(r"^> done: 3 iterations \| final validation loss 2\.5000 \| throughput \d+ tokens/s$",
                     capsys.readouterr().out, re.M)
    summary = _run(FakeFramework(monkeypatch), _args("--train-iters", "1"), summary_keys=("parameters", "iteration"))
    assert list(summary.items()) == [("parameters", 123), ("iteration", 1)]     # the trainer's order, not the loop's


@pytest.mark.parametrize("iterations, exit_interval, expected", [(10, None, 10), (10, 4, 4), (3, 7, 3)])
def test_stop_iteration(iterations, exit_interval, expected):
    argv = ["--train-iters", str(iterations)] + (["--exit-interval", str(exit_interval)] if exit_interval else [])
    assert loop.stop_iteration(_args(*argv)) == expected


def test_a_signal_during_a_step_saves_that_iteration_and_exits_without_final_validation(monkeypatch, capsys,
                                                                                        tmp_path):
    fake = FakeFramework(monkeypatch, signal_at=3)
    before = signal.getsignal(signal.SIGTERM)
    summary = _run(fake, _args("--train-iters", "10", "--save", str(tmp_path), "--save-interval", "2",
                               "--eval-interval", "5", "--exit-signal-handler"))
    assert [s[0] for s in fake.of("step")] == [1, 2, 3]
    assert fake.of("save") == [(2, 2 * GBS), (3, 3 * GBS)] and fake.evaluated_after() == []
    assert summary["iteration"] == 3 and summary["final_valid_loss"] is None
    assert fake.votes == [(1, False), (2, False), (3, True)]     # asked after every step, once
    assert signal.getsignal(signal.SIGTERM) is before              # the previous handler is back
    out = capsys.readouterr().out
    assert "> exiting at iteration 3: received SIGTERM\n" in out
    assert "> done: 3 iterations | final validation loss n/a |" in out


def test_a_signal_to_another_rank_stops_this_one_at_the_same_iteration(monkeypatch, tmp_path):
    fake = FakeFramework(monkeypatch, other_rank_at=2)
    summary = _run(fake, _args("--train-iters", "10", "--save", str(tmp_path), "--exit-signal-handler"))
    assert summary["iteration"] == 2 and fake.of("save") == [(2, 2 * GBS)]


def test_without_save_the_signal_still_stops_the_run_and_says_nothing_was_saved(monkeypatch, capsys):
    fake = FakeFramework(monkeypatch, signal_at=1)
    summary = _run(fake, _args("--train-iters", "4", "--exit-signal-handler"))
    assert summary["iteration"] == 1 and fake.of("save") == []
    assert "> exiting at iteration 1: received SIGTERM (no --save: nothing saved)" in capsys.readouterr().out


def test_the_handler_acts_on_exit_signal_only(monkeypatch, tmp_path):
    fake = FakeFramework(monkeypatch)
    args = _args("--train-iters", "3", "--exit-signal-handler", "--exit-signal", "SIGUSR1")

    def step_and_signal(iteration, consumed, batch_size):
        result = fake.step(iteration, consumed, batch_size)
        if iteration == 2:
            os.kill(os.getpid(), signal.SIGUSR1)
        return result
    parts = dataclasses.replace(fake.parts(), step=step_and_signal)
    summary = loop.train(args, TrainingLogger(args, is_writer=True), parts, _report(args), loop.Progress(),
                         publish=fake.publish)
    assert summary["iteration"] == 2


def test_past_the_time_limit_the_run_saves_and_stops_after_the_step(monkeypatch, capsys, tmp_path):
    fake = FakeFramework(monkeypatch)
    args = _args("--train-iters", "10", "--save", str(tmp_path), "--exit-duration-in-mins", "1")
    summary = _run(fake, args, started_at=time.time() - 61)
    assert summary["iteration"] == 1 and fake.of("save") == [(1, GBS)]
    assert "> exiting at iteration 1: the time limit (--exit-duration-in-mins 1) was reached" in capsys.readouterr().out
    fake = FakeFramework(monkeypatch)
    assert _run(fake, args, started_at=time.time())["iteration"] == 10     # within the limit: the whole run


BOTH_RULES = ("--exit-signal-handler", "--exit-duration-in-mins", "1")


def test_with_both_exit_rules_a_signal_is_one_vote_per_step_and_named(monkeypatch, capsys, tmp_path):
    fake = FakeFramework(monkeypatch, signal_at=3)
    summary = _run(fake, _args("--train-iters", "10", "--save", str(tmp_path), *BOTH_RULES), started_at=time.time())
    assert summary["iteration"] == 3 and fake.of("save") == [(3, 3 * GBS)]
    assert fake.votes == [(1, False), (2, False), (3, True)]     # one collective per step, not one per rule
    assert "> exiting at iteration 3: received SIGTERM\n" in capsys.readouterr().out


def test_with_both_exit_rules_the_time_limit_is_one_vote_and_named(monkeypatch, capsys, tmp_path):
    fake = FakeFramework(monkeypatch)
    summary = _run(fake, _args("--train-iters", "10", "--save", str(tmp_path), *BOTH_RULES),
                   started_at=time.time() - 61)
    assert summary["iteration"] == 1 and fake.votes == [(1, True)]
    assert "> exiting at iteration 1: the time limit (--exit-duration-in-mins 1) was reached\n" in \
        capsys.readouterr().out


def test_another_ranks_vote_names_the_rule_that_is_on_or_both(monkeypatch, capsys, tmp_path):
    for rules, said in [(("--exit-signal-handler",), "received SIGTERM"),
                        (("--exit-duration-in-mins", "1"), "the time limit (--exit-duration-in-mins 1) was reached"),
                        (BOTH_RULES, "another rank received SIGTERM or reached the time limit "
                                     "(--exit-duration-in-mins 1)")]:
        fake = FakeFramework(monkeypatch, other_rank_at=2)
        summary = _run(fake, _args("--train-iters", "10", *rules), started_at=time.time())
        assert summary["iteration"] == 2 and fake.votes == [(1, False), (2, False)]
        assert f"> exiting at iteration 2: {said} (no --save" in capsys.readouterr().out


def test_without_an_exit_rule_the_ranks_are_never_asked(monkeypatch):
    fake = FakeFramework(monkeypatch)
    _run(fake, _args("--train-iters", "3"))
    assert fake.votes == []
