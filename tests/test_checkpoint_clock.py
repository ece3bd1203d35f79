"""Checkpoints after evaluations take at most train.checkpoint_share of the wall (zoo.train.CheckpointClock), and
a finished run always keeps its final weights."""

import pytest
from tiny_run import TINY_RUN

from zoo.runs import RunDir
from zoo.train import CheckpointClock, load_config, run_name, train

QUICK = ["model=based", *TINY_RUN, "train.progress=false", "train.early_stop=null"]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def write(clock: CheckpointClock, fake: FakeClock, seconds: float) -> None:
    with clock.timed():
        fake.t += seconds


def test_first_evaluation_checkpoints():
    assert CheckpointClock(0.05, clock=FakeClock()).due()


def test_next_checkpoint_waits_cost_over_share():
    fake = FakeClock()
    clock = CheckpointClock(0.25, clock=fake)
    assert clock.due()
    write(clock, fake, 1.0)  # one member's checkpoint: 1 s, ending at t = 1
    write(clock, fake, 1.0)  # the pack's second member: the evaluation's checkpoints cost 2 s, ending at t = 2
    fake.t = 9.9  # 7.9 s since the last ended, below 2 / 0.25 = 8
    assert not clock.due()
    fake.t = 10.0
    assert clock.due()
    write(clock, fake, 0.5)  # a cheaper checkpoint shortens the wait: 0.5 / 0.25 = 2 s after t = 10.5
    fake.t = 12.4
    assert not clock.due()
    fake.t = 12.5
    assert clock.due()


def test_share_one_checkpoints_every_evaluation():
    fake = FakeClock()
    clock = CheckpointClock(1.0, clock=fake)
    for _ in range(3):
        assert clock.due()
        write(clock, fake, 100.0)


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_share_outside_0_1_is_refused(tmp_path, share):
    with pytest.raises(Exception, match="checkpoint_share must be in"):
        load_config([*QUICK, f"runs_root={tmp_path}", f"train.checkpoint_share={share}"])


def test_share_is_not_part_of_the_run_name(tmp_path):
    a, _ = load_config([*QUICK, f"runs_root={tmp_path}"])
    b, _ = load_config([*QUICK, f"runs_root={tmp_path}", "train.checkpoint_share=1"])
    assert run_name(a) == run_name(b)


class OnlyFirst(CheckpointClock):
    """A clock under which only the first evaluation is due (checkpoints that cost far more than an epoch)."""

    def due(self) -> bool:
        due = self.last is None
        if due:
            self.cost = 0.0
        return due


@pytest.fixture
def saved_epochs(monkeypatch):
    """The epoch of every checkpoint written, in order, under a clock where only the first evaluation is due."""
    saved = []
    original = RunDir.save_checkpoint

    def recording(self, state):
        saved.append(state["epoch"])
        original(self, state)

    monkeypatch.setattr(RunDir, "save_checkpoint", recording)
    monkeypatch.setattr("zoo.train.CheckpointClock", OnlyFirst)
    return saved


def test_skipped_checkpoints_still_leave_the_final_weights(tmp_path, saved_epochs):
    cfg, resolved = load_config([*QUICK, f"runs_root={tmp_path}", "train.epochs=4"])
    summary = train(cfg, resolved)
    assert saved_epochs == [1, 4]  # the first evaluation, then the finished run's final weights
    ckpt = RunDir(tmp_path / "default" / run_name(cfg)).load_checkpoint()
    assert ckpt["step"] == summary["steps"] and ckpt["epoch"] == 4


def test_run_that_stops_early_keeps_its_final_weights(tmp_path, monkeypatch, saved_epochs):
    calls = []

    def evaluate(model, segments, split, amp):  # below early_stop at the first evaluation, above it after
        calls.append(split)
        accuracy = 0.1 if len(calls) == 1 else 0.6
        return {f"{split}/accuracy": accuracy, f"{split}/loss": 1.0}

    monkeypatch.setattr("zoo.train.evaluate", evaluate)
    cfg, resolved = load_config([*QUICK, f"runs_root={tmp_path}", "train.epochs=6", "train.early_stop=0.5"])
    summary = train(cfg, resolved)
    assert summary["stopped_early"] and summary["epochs"] == 2
    assert saved_epochs == [1, 2]  # the first evaluation, then the weights it stopped with (an evaluation not due)
    assert RunDir(tmp_path / "default" / run_name(cfg)).load_checkpoint()["step"] == summary["steps"]
