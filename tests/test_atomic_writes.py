"""zoo.runs' atomic writes: a write killed midway leaves the file it replaces whole and no temporary file behind."""

import pytest

from zoo.runs import atomic_savefig, atomic_torch_save, atomic_write_text


class Killed(Exception):
    pass


def _half_written(path, data: bytes):
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])
    raise Killed


class Figure:
    """Stands in for a matplotlib figure: savefig writes half of its bytes, then dies (kill=True)."""

    def __init__(self, data: bytes, kill: bool):
        self.data, self.kill = data, kill

    def savefig(self, path, **kwargs):
        if self.kill:
            _half_written(path, self.data)
        with open(path, "wb") as f:
            f.write(self.data)


def test_savefig_killed_leaves_the_old_figure(tmp_path):
    path = tmp_path / "fig.png"
    atomic_savefig(Figure(b"old figure bytes", kill=False), path, dpi=100)
    with pytest.raises(Killed):
        atomic_savefig(Figure(b"a new figure, larger than the old one", kill=True), path, dpi=100)
    assert path.read_bytes() == b"old figure bytes"
    assert [p.name for p in tmp_path.iterdir()] == ["fig.png"]


def test_savefig_keeps_the_suffix_for_the_format(tmp_path):
    """matplotlib picks the format from the file name, so the temporary file keeps the target's suffix."""
    seen = []

    class Probe(Figure):
        def savefig(self, path, **kwargs):
            seen.append(str(path))
            super().savefig(path, **kwargs)

    atomic_savefig(Probe(b"x", kill=False), tmp_path / "a.pdf")
    assert seen[0].endswith(".pdf") and (tmp_path / "a.pdf").read_bytes() == b"x"


def test_real_matplotlib_figure(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    atomic_savefig(fig, tmp_path / "line.png", dpi=50)
    plt.close(fig)
    assert (tmp_path / "line.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_write_text_and_torch_save_replace_whole(tmp_path):
    import torch

    atomic_write_text(tmp_path / "a.json", "{}\n")
    assert (tmp_path / "a.json").read_text() == "{}\n"
    atomic_torch_save({"x": torch.ones(2)}, tmp_path / "c.pt")
    assert torch.load(tmp_path / "c.pt")["x"].equal(torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "c.pt"]
