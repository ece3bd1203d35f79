"""train.pack_stop=first: once one member of a pack reaches early_stop, its siblings stop there too, each
finalised where it stands with its final weights and `stopped_by_pack` in its summary; pack_stop=each (the
default) lets them train on. CPU, a pack of two tiny runs, validation accuracy scripted per member."""

import pytest
from test_checkpoint_clock import OnlyFirst
from tiny_run import TINY_RUN

from zoo.runs import RunDir
from zoo.steps import PackedStep, pack_members
from zoo.train import load_config, run_name, train_runs

TINY = ["model=based", *TINY_RUN, "train.progress=false", "train.epochs=4", "train.early_stop=0.99"]
LRS = [1e-3, 1e-2]


def train_pack(tmp_path, monkeypatch, pack_stop: str):
    """Train a pack of LRS; the lr 1e-2 member scores 0.995 on valid from its second evaluation on, the other
    0.1 throughout (the evaluated model is tagged with its member's lr by a wrapped PackedStep.model_of)."""
    cfg, _ = load_config([*TINY, f"runs_root={tmp_path}", f"train.pack_stop={pack_stop}"])
    members = pack_members(cfg, LRS)
    model_of = PackedStep.model_of
    seen = {lr: 0 for lr in LRS}

    def tagged(self, row):
        model = model_of(self, row)
        model.zoo_test_lr = self.members[self.live[row]].optim.lr
        return model

    def evaluate(model, segments, split, amp):
        if split == "test":
            return {"test/accuracy": 0.5, "test/loss": 1.0}
        lr = model.zoo_test_lr
        seen[lr] += 1
        return {"valid/accuracy": 0.995 if lr == 1e-2 and seen[lr] >= 2 else 0.1, "valid/loss": 1.0}

    monkeypatch.setattr(PackedStep, "model_of", tagged)
    monkeypatch.setattr("zoo.train.evaluate", evaluate)
    monkeypatch.setattr("zoo.train.CheckpointClock", OnlyFirst)  # the stop's evaluation is not a due checkpoint
    return members, train_runs(members)


def test_first_stops_the_siblings_where_they_stand(tmp_path, monkeypatch):
    members, (slow, solved) = train_pack(tmp_path, monkeypatch, "first")
    assert solved["stopped_early"] and solved["epochs"] == 2 and "stopped_by_pack" not in solved
    assert slow["stopped_by_pack"] and not slow["stopped_early"] and slow["epochs"] == 2
    assert slow["steps"] == solved["steps"]
    for member, summary in zip(members, (slow, solved)):
        run = RunDir(tmp_path / "default" / run_name(member))
        assert run.is_finished()
        assert run.load_checkpoint()["step"] == summary["steps"]  # final weights kept


def test_each_lets_the_siblings_train_on(tmp_path, monkeypatch):
    _, (slow, solved) = train_pack(tmp_path, monkeypatch, "each")
    assert solved["stopped_early"] and solved["epochs"] == 2
    assert "stopped_by_pack" not in slow and slow["epochs"] == 4


def test_pack_stop_is_checked_and_not_part_of_the_run_name(tmp_path):
    with pytest.raises(Exception, match="pack_stop must be each|first"):
        load_config([*TINY, f"runs_root={tmp_path}", "train.pack_stop=all"])
    a, _ = load_config([*TINY, f"runs_root={tmp_path}"])
    b, _ = load_config([*TINY, f"runs_root={tmp_path}", "train.pack_stop=first"])
    assert run_name(a) == run_name(b)
