"""zoo.runs' atomic writes: a write killed midway leaves the file it replaces whole and no temporary file behind."""

import pytest

from zoo.atomic import atomic_savefig, atomic_torch_save, atomic_write_text


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


@pytest.fixture
def mask():
    """Run a test under a chosen umask, restored afterwards."""
    import os

    old = os.umask(0o022)
    yield lambda m: os.umask(m)
    os.umask(old)


def _write_each(kind: str, path):
    import torch

    if kind == "text":
        atomic_write_text(path, "x")
    elif kind == "figure":
        atomic_savefig(Figure(b"png", kill=False), path)
    else:
        atomic_torch_save({"x": torch.ones(1)}, path)


WRITERS = {"text": "a.json", "figure": "b.png", "torch": "c.pt"}


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077], ids=lambda m: f"umask{m:03o}")
@pytest.mark.parametrize("kind", list(WRITERS))
def test_a_new_file_gets_the_umask_mode(tmp_path, mask, kind, umask):
    """A new file is as readable as `open` would make it (0o644 under umask 022), not mkstemp's private 0o600: other
    users of a shared filesystem read the runs, summaries and figures."""
    mask(umask)
    path = tmp_path / WRITERS[kind]
    _write_each(kind, path)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


@pytest.mark.parametrize("kind", list(WRITERS))
def test_a_replaced_file_keeps_its_mode(tmp_path, mask, kind):
    path = tmp_path / WRITERS[kind]
    _write_each(kind, path)
    path.chmod(0o640)
    _write_each(kind, path)
    assert path.stat().st_mode & 0o777 == 0o640


def _synthetics_segment(root):
    from zoo.synthetics import cached_generate
    from zoo.synthetics.mqar import MQARConfig

    cached_generate(MQARConfig(vocab_size=64, seq_len=16, num_kv_pairs=2, num_examples=4), 0, cache_dir=root)
    (segment,) = [p for p in root.iterdir() if not p.name.startswith(".")]
    return segment


def _self_study_dataset(root):
    pytest.importorskip("datasets")
    from cartridges.self_study import write_dataset

    return write_dataset(root, [{"messages": "hi"}])


@pytest.mark.parametrize("where", ["synthetics-cache", "self-study-dataset"])
def test_a_published_directory_gets_the_umask_mode(tmp_path, mask, where):
    """A directory made by mkdtemp (0o700) and renamed into place ends as a new directory would (0o750 under umask
    027): zoo.synthetics' cached segments, cartridges-synthesize's dataset."""
    mask(0o027)
    directory = {"synthetics-cache": _synthetics_segment, "self-study-dataset": _self_study_dataset}[where](tmp_path)
    assert directory.is_dir() and directory.stat().st_mode & 0o777 == 0o750


def test_staged_dir_replaces_a_tree_whole_with_readable_files(tmp_path, mask):
    """The new tree takes the old one's place, and a file that its writer made private (safetensors' save_file
    writes 0o600) is published with the umask's mode."""
    import os

    from zoo.atomic import staged_dir

    mask(0o022)
    target = tmp_path / "adapter"
    target.mkdir()
    (target / "stale.bin").write_bytes(b"old")
    with staged_dir(target) as staging:
        (staging / "sub").mkdir()
        fd = os.open(staging / "sub" / "weights.safetensors", os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"new")
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert [p.name for p in target.iterdir()] == ["sub"]
    assert (target / "sub" / "weights.safetensors").stat().st_mode & 0o777 == 0o644
    assert (target / "sub").stat().st_mode & 0o777 == 0o755


def test_staged_dir_leaves_the_old_tree_on_an_error(tmp_path):
    from zoo.atomic import staged_dir

    target = tmp_path / "dataset"
    target.mkdir()
    (target / "data.arrow").write_bytes(b"old")
    with pytest.raises(Killed):
        with staged_dir(target) as staging:
            (staging / "data.arrow").write_bytes(b"half")
            raise Killed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset"]
    assert (target / "data.arrow").read_bytes() == b"old"
