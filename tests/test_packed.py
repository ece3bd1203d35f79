"""Packed training (zoo/steps.py) on CPU: each member of a pack equals its standalone zoo-train run, on disk
and in its parameters; a member that stops early leaves the others untouched; a killed pack resumes, and only
from one checkpoint all its members share; every registered mixer (impl=naive) runs under vmap; a pack that
cannot run fails before any work, in one line."""

import pytest
import torch

from zoo.cli import run_train as main
from zoo.eval import query_loss
from zoo.models import LanguageModel
from zoo.models.mixers import MIXERS
from zoo.runs import RunDir
from zoo.steps import PackedParams as _Pack
from zoo.steps import PackError, check_pack, pack_members
from zoo.train import ConfigError, epoch_plan, load_config, run_name, train, train_runs

TINY = [
    "model.d_model=16",
    "data.vocab_size=64",
    "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:64,batch_size:16}]",
    "data.valid=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
    "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32},"
    "{seq_len:32,num_kv_pairs:4,num_examples:32,batch_size:32}]",
    "optim.warmup_frac=0.25",  # warmup and cosine both happen within the few steps
    "optim.grad_clip=0.5",
    "train.log_every=2",
    "train.progress=false",
]
LRS = [1e-3, 1e-2, 3e-2]
# Wall-clock fields differ between any two runs; pack_size exists only in packed summaries.
UNTIMED = ("wall_time_s", "train_tokens_per_s", "pack_size")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These models are tiny: a second intra-op thread only adds contention on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def cfg_of(root, *extra):
    return load_config([*TINY, f"runs_root={root}", *extra])


def standalone(root, lr, *extra):
    cfg, resolved = cfg_of(root, f"optim.lr={lr}", *extra)
    return train(cfg, resolved)


def packed(root, lrs, *extra):
    cfg, _ = cfg_of(root, *extra)
    return train_runs(pack_members(cfg, lrs))


def set_aside(root):
    """Move root's runs to root/ref, so a second training in the same runs_root gets the same run names."""
    (root / "default").rename(root / "ref")
    return root / "ref"


def assert_same_run(ref_dir, got_dir, atol=2e-5, config=True):
    """Two run dirs hold the same run: config, metrics, summary and checkpoint (up to float rounding)."""
    ref, got = RunDir(ref_dir), RunDir(got_dir)
    if config:
        assert (ref.path / "config.yaml").read_text() == (got.path / "config.yaml").read_text()
    ref_m, got_m = ref.read_metrics(), got.read_metrics()
    assert [sorted(r) for r in ref_m] == [sorted(r) for r in got_m]
    for r, g in zip(ref_m, got_m):
        assert g == pytest.approx(r, rel=1e-4, abs=atol), (r, g)
    ref_s, got_s = ref.read_summary(), got.read_summary()
    assert set(got_s) ^ set(ref_s) <= {"pack_size"} and "pack_size" in got_s
    for key, value in ref_s.items():
        if isinstance(value, float) and key not in UNTIMED:
            assert got_s[key] == pytest.approx(value, rel=1e-4, abs=atol), key
        elif key not in UNTIMED:
            assert got_s[key] == value, key
    ref_c, got_c = ref.load_checkpoint(), got.load_checkpoint()
    for name, value in ref_c["model"].items():
        torch.testing.assert_close(got_c["model"][name], value, rtol=1e-4, atol=atol)
    ref_o, got_o = ref_c["optimizer"], got_c["optimizer"]
    assert ref_o["param_groups"] == got_o["param_groups"]
    assert ref_o["state"].keys() == got_o["state"].keys()
    for k, state in ref_o["state"].items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got_o["state"][k][name], state[name], rtol=1e-3, atol=1e-7)
        assert float(got_o["state"][k]["step"]) == float(state["step"])
    assert ref_c["scheduler"] == got_c["scheduler"]
    assert (ref_c["epoch"], ref_c["step"], ref_c["train_tokens"]) == (
        got_c["epoch"],
        got_c["step"],
        got_c["train_tokens"],
    )


@pytest.mark.parametrize("model", ["attention", "based"])
def test_pack_equals_standalone_runs(tmp_path, model):
    extra = (f"model={model}", "train.epochs=2", "train.early_stop=null")
    refs = [standalone(tmp_path, lr, *extra) for lr in LRS]
    ref_root = set_aside(tmp_path)
    got = packed(tmp_path, LRS, *extra)
    assert [s["run"] for s in got] == [s["run"] for s in refs]
    assert all(s["pack_size"] == len(LRS) for s in got)
    assert len({s["test/accuracy"] for s in got}) > 1, "the learning rates made no difference: a useless test"
    for s in refs:
        assert_same_run(ref_root / s["run"], tmp_path / "default" / s["run"])


def seed_members(root, pairs, *extra):
    """Pack members at each (lr, seed) of `pairs`."""
    return [cfg_of(root, f"optim.lr={lr}", f"train.seed={seed}", *extra)[0] for lr, seed in pairs]


SEED_PAIRS = [(1e-3, 0), (1e-2, 0), (1e-3, 1), (3e-2, 2)]


# 56 examples in batches of 16: each seed's epoch puts its batch of 8 at its own step
PARTIAL = "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:56,batch_size:16}]"


class Examples56:
    """What epoch_plan reads of PARTIAL's training segment."""

    batch_size = 16

    def __len__(self) -> int:
        return 56


def test_the_seeds_put_their_last_batch_at_different_steps():
    """What the partial case below relies on: a step where one member's batch is shorter than another's."""
    segments = [Examples56()]
    sizes = {seed: [idx.numel() for _, idx in epoch_plan(segments, seed, 0)] for _, seed in SEED_PAIRS}
    assert len({tuple(v) for v in sizes.values()}) > 1, sizes


@pytest.mark.parametrize("batches", ["full", "partial"])
@pytest.mark.parametrize("model", ["attention", "based"])
def test_a_pack_of_several_seeds_equals_standalone_runs(tmp_path, model, batches):
    """Members of other seeds start from their own seed's init and see their own seed's batch order, the last,
    shorter batch of an epoch included, which falls on another step for each seed."""
    extra = (f"model={model}", "train.epochs=2", "train.early_stop=null", *([PARTIAL] if batches == "partial" else []))
    refs = [train(*cfg_of(tmp_path, f"optim.lr={lr}", f"train.seed={seed}", *extra)) for lr, seed in SEED_PAIRS]
    ref_root = set_aside(tmp_path)
    got = train_runs(seed_members(tmp_path, SEED_PAIRS, *extra))
    assert [s["run"] for s in got] == [s["run"] for s in refs]
    assert all(s["pack_size"] == len(SEED_PAIRS) for s in got)
    assert refs[0]["test/loss"] != refs[2]["test/loss"], "the seeds made no difference: a useless test"
    for s in refs:
        assert_same_run(ref_root / s["run"], tmp_path / "default" / s["run"])


def test_a_pack_of_several_seeds_needs_one_training_segment(tmp_path):
    mixture = ("data.train=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:16},"
               "{seq_len:32,num_kv_pairs:4,num_examples:32,batch_size:16}]")
    with pytest.raises(PackError) as e:
        check_pack(seed_members(tmp_path, [(1e-3, 0), (1e-3, 1)], mixture))
    assert "several seeds pack only with one training segment (data.train has 2)" in one_line(e)
    check_pack(seed_members(tmp_path, [(1e-3, 0), (1e-2, 0)], mixture))  # one seed: a mixture packs
    with pytest.raises(PackError) as e:
        check_pack(seed_members(tmp_path, [(1e-3, 0), (1e-3, 1), (1e-3, 1)]))
    assert "(lr, seed) pairs of a pack must be distinct" in one_line(e)


@pytest.mark.parametrize("pairs", [[(lr, 0) for lr in LRS], [(3e-2, 0), (3e-2, 1), (1e-2, 2)]],
                         ids=["lrs", "seeds"])
def test_early_stopped_member_leaves_the_others_as_standalone(tmp_path, pairs):
    epochs = 3
    extra = ("model=attention", f"train.epochs={epochs}")
    curves = []
    for lr, seed in pairs:
        cfg, resolved = cfg_of(tmp_path / "null", f"optim.lr={lr}", f"train.seed={seed}", *extra,
                               "train.early_stop=null")
        train(cfg, resolved)
        metrics = RunDir(tmp_path / "null" / "default" / run_name(cfg)).read_metrics()
        curves.append([r["valid/accuracy"] for r in metrics if "valid/accuracy" in r])
    # A threshold that exactly one member reaches, before the last epoch, and no other member ever does.
    stop = None
    for i, curve in enumerate(curves):
        others = max(a for j, c in enumerate(curves) if j != i for a in c)
        for e, acc in enumerate(curve[:-1]):
            if acc > others and acc > max(curve[:e], default=0.0):
                stop = (i, e + 1, acc)
                break
        if stop:
            break
    assert stop is not None, f"no member stops alone with these curves: {curves}; change the config"
    i_stop, epoch_stop, threshold = stop
    early = f"train.early_stop={threshold!r}"

    refs = [train(*cfg_of(tmp_path, f"optim.lr={lr}", f"train.seed={seed}", *extra, early)) for lr, seed in pairs]
    ref_root = set_aside(tmp_path)
    got = train_runs(seed_members(tmp_path, pairs, *extra, early))
    n = len(pairs)
    assert [s["stopped_early"] for s in refs] == [s["stopped_early"] for s in got] == [i == i_stop for i in range(n)]
    assert [s["epochs"] for s in got] == [epoch_stop if i == i_stop else epochs for i in range(n)]
    for s in refs:
        assert_same_run(ref_root / s["run"], tmp_path / "default" / s["run"])


def test_killed_pack_resumes_exactly(tmp_path, monkeypatch):
    # every evaluation checkpoints (share 1), so the kill below lands after epoch 2's checkpoints
    extra = ("model=based", "train.epochs=3", "train.early_stop=null", "train.checkpoint_share=1")
    reference = packed(tmp_path, LRS[:2], *extra)
    ref_root = set_aside(tmp_path)

    saves = []
    real_save = RunDir.save_checkpoint

    def save_then_die(self, state):
        real_save(self, state)
        saves.append(state["epoch"])
        if len(saves) == 2 * len(LRS[:2]):  # every member saved epoch 2
            raise KeyboardInterrupt

    monkeypatch.setattr(RunDir, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        packed(tmp_path, LRS[:2], *extra)
    monkeypatch.setattr(RunDir, "save_checkpoint", real_save)
    assert saves == [1, 1, 2, 2]
    with pytest.raises(ConfigError, match="already holds a run"):
        packed(tmp_path, LRS[:2], *extra)
    resumed = packed(tmp_path, LRS[:2], *extra, "train.resume=true")
    for ref in reference:
        # config.yaml differs only in `resume: true`, as for a resumed zoo.train run.
        assert_same_run(ref_root / ref["run"], tmp_path / "default" / ref["run"], 1e-6, config=False)
    # Finished members are not trained again.
    assert packed(tmp_path, LRS[:2], *extra, "train.resume=true") == resumed


def test_a_killed_pack_of_several_seeds_resumes_exactly(tmp_path, monkeypatch):
    extra = ("model=based", "train.epochs=3", "train.early_stop=null", "train.checkpoint_share=1")
    pairs = [(1e-3, 0), (1e-2, 1)]
    reference = train_runs(seed_members(tmp_path, pairs, *extra))
    ref_root = set_aside(tmp_path)
    real_save, saves = RunDir.save_checkpoint, []

    def save_then_die(self, state):
        real_save(self, state)
        saves.append(state["epoch"])
        if len(saves) == 2 * len(pairs):  # every member saved epoch 2
            raise KeyboardInterrupt

    monkeypatch.setattr(RunDir, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        train_runs(seed_members(tmp_path, pairs, *extra))
    monkeypatch.setattr(RunDir, "save_checkpoint", real_save)
    train_runs(seed_members(tmp_path, pairs, *extra, "train.resume=true"))
    for ref in reference:
        assert_same_run(ref_root / ref["run"], tmp_path / "default" / ref["run"], 1e-6, config=False)


MIXER_OPTIONS = {"based": {"feature_dim": 4}, "h3": {"d_state": 8}, "hyena": {"max_seq_len": 16}}


def tiny_pack(mixer: str):
    """(model, a pack of 2 lrs of it, inputs, query positions, labels): two layers of one mixer, d=16, V=64."""
    from zoo.config import ModelConfig

    torch.manual_seed(0)
    options = {mixer: MIXER_OPTIONS[mixer]} if mixer in MIXER_OPTIONS else {}
    cfg, _ = load_config([*TINY])
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=16, n_layers=2, pattern=[mixer], mixers=options))
    pack = _Pack(model, [1e-3, 2e-3], cfg.optim, total_steps=1)
    batch = torch.randint(0, 64, (4, 16)), torch.randint(0, 16, (4, 3)), torch.randint(0, 64, (4, 3))
    return model, pack, *batch


CHUNKED = {
    "deltanet-chunk": ("deltanet", {"impl": "chunk", "chunk_size": 4}),
    "gated_deltanet-chunk": ("gated_deltanet", {"impl": "chunk", "chunk_size": 4}),
}


@pytest.mark.parametrize("mixer", sorted(MIXERS) + sorted(CHUNKED))
def test_every_naive_mixer_packs(mixer, monkeypatch):
    """Under vmap, each member's loss and gradient equal the plain model's (every mixer at impl=naive, and the
    chunked delta rules, which packs also accept)."""
    if mixer in CHUNKED:
        mixer, options = CHUNKED[mixer]
        monkeypatch.setitem(MIXER_OPTIONS, mixer, options)
    model, pack, inputs, query_pos, query_labels = tiny_pack(mixer)
    losses = pack.losses(inputs, query_pos, query_labels)  # [2]
    losses.sum().backward()
    loss = query_loss(model, inputs, query_pos, query_labels)
    loss.backward()
    grad = torch.cat([p.grad.reshape(-1) for _, p in model.named_parameters()])
    for member in range(2):
        torch.testing.assert_close(losses[member], loss, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pack.flat.grad[member], grad, rtol=1e-4, atol=1e-6)


def test_a_packs_residual_stream_lies_member_by_member():
    """In a vmapped pack each member's activations are contiguous: the norms read [N, B, T, d] unit-stride. The
    embedding's batching rule returns the members interleaved ([B, T, N, d] in memory), which would make every
    elementwise op of the residual stream a strided one on the GPU."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from zoo.config import ModelConfig

    class NormInputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.contiguous = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.native_layer_norm.default:
                self.contiguous.append(args[0].is_contiguous())
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=16, n_layers=2, pattern=["attention"],
                                      norm="layernorm"))
    cfg, _ = load_config([*TINY])
    pack = _Pack(model, [1e-3, 2e-3], cfg.optim, total_steps=1)
    batch = torch.randint(0, 64, (4, 16)), torch.randint(0, 16, (4, 3)), torch.randint(0, 64, (4, 3))
    with NormInputs() as seen:
        pack.losses(*batch)
    assert len(seen.contiguous) == 3 and all(seen.contiguous), seen.contiguous  # two blocks' norms, the final one


def assert_compiled_pack_equals_eager_pack(pattern: list[str], options: dict) -> None:
    """torch.compile over the vmapped loss of a pack of two lrs: loss and gradients equal the eager pack's."""
    from zoo.config import ModelConfig

    torch.manual_seed(0)
    model = LanguageModel(ModelConfig(vocab_size=64, d_model=16, n_layers=2, pattern=pattern, mixers=options))
    cfg, _ = load_config([*TINY])
    batch = torch.randint(0, 64, (4, 16)), torch.randint(0, 16, (4, 3)), torch.randint(0, 64, (4, 3))
    results = []
    for mode in (None, "default"):
        pack = _Pack(model, [1e-3, 2e-3], cfg.optim, total_steps=1, compile_mode=mode)
        losses = pack.losses(*batch)  # [2]
        losses.sum().backward()
        results.append((losses.detach(), pack.flat.grad))
    (eager_loss, eager_grad), (compiled_loss, compiled_grad) = results
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-4, atol=1e-6)


def test_a_compiled_pack_of_h3_with_zoologys_complex_ssm_equals_the_eager_pack():
    """H3 with ssm=zoology (complex S4D-Lin modes built with torch.complex) packs under vmap and compiles."""
    assert_compiled_pack_equals_eager_pack(
        ["h3"], {"h3": {"d_state": 8, "shift_size": 8, "head_dim": 2, "ssm": "zoology"}})


@pytest.mark.parametrize("positions", ["fixed", "zoology"])
def test_a_compiled_pack_of_the_fig2_hyena_equals_the_eager_pack(positions):
    """Zoology Fig. 2's Hyena (learned sine frequencies shared by the filter's three activations; with Zoology's
    positions, a learned table sliced to the sequence). The frequencies were once one module reused in the
    filter's Sequential, which inductor refused under vmap ("Cannot access storage of BatchedTensorImpl")."""
    assert_compiled_pack_equals_eager_pack(
        ["hyena"], {"hyena": {"max_seq_len": 16, "learn_freq": True, "filter_depth": 2, "positions": positions,
                              "num_freqs": 1 if positions == "zoology" else 0}})


def one_line(exc_info) -> str:
    message = str(exc_info.value)
    assert "\n" not in message
    return message


def test_invalid_packs_fail_in_one_line(tmp_path, capsys):
    with pytest.raises(ConfigError) as e:
        cfg_of(tmp_path, "train.pack_lrs=[1e-3,1e-3]")
    assert "train.pack_lrs must hold distinct" in one_line(e)

    cfg, _ = cfg_of(tmp_path, "model=based")
    other, _ = cfg_of(tmp_path, "model=based", "model.d_model=32", "optim.lr=0.01")
    with pytest.raises(PackError) as e:
        check_pack([cfg, other])
    assert "differ only in optim.lr" in one_line(e) and "model.d_model: 16 vs 32" in one_line(e)

    cfg, _ = cfg_of(tmp_path, "model=based", "+model.mixers.based.impl=fla")  # FLA's kernels have no vmap rule
    with pytest.raises(PackError) as e:
        check_pack(pack_members(cfg, LRS))
    assert "mixer based has impl=fla" in one_line(e)

    cfg, _ = cfg_of(tmp_path, "train.pack_lrs=[1e-3,1e-2]")
    with pytest.raises(ConfigError, match="train.pack_lrs or train.pack_seeds is set"):
        train(cfg)


def test_a_compiled_pack_trains_as_the_eager_pack(tmp_path, monkeypatch):
    """train.compile=true compiles the vmapped loss: the runs equal those of the eager pack (to rounding)."""
    packed(tmp_path, LRS[:2], "train.epochs=1")
    ref_root = set_aside(tmp_path)
    compiled = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(fn) or real_compile(fn, **kw))
    summaries = packed(tmp_path, LRS[:2], "train.epochs=1", "train.compile=true")
    assert compiled, "train.compile=true did not compile the pack's loss"
    for summary in summaries:
        assert_same_run(ref_root / summary["run"], tmp_path / "default" / summary["run"], 1e-5, config=False)


def test_zoo_train_pack_seeds_writes_one_run_per_seed_and_lr(tmp_path, capsys):
    main([*TINY, f"runs_root={tmp_path}", "model=attention", "train.epochs=1", "train.pack_seeds=[3,1]",
          "train.pack_lrs=[1e-3,1e-2]"])
    runs = sorted(p.name for p in (tmp_path / "default").iterdir())
    assert len(runs) == 4 and {r.split("-s")[-1].split("-")[0] for r in runs} == {"1", "3"}
    summaries = [RunDir(tmp_path / "default" / r).read_summary() for r in runs]
    assert sorted((s["seed"], s["lr"]) for s in summaries) == [(1, 1e-3), (1, 1e-2), (3, 1e-3), (3, 1e-2)]
    assert all(s["pack_size"] == 4 for s in summaries)
    with pytest.raises(ConfigError, match="train.pack_seeds must hold distinct seeds"):
        cfg_of(tmp_path, "train.pack_seeds=[1,1]")


def test_a_compiled_pack_of_several_seeds_trains_as_the_eager_one(tmp_path):
    """The compiled loss that takes a batch per member: the runs equal those of the eager seed pack."""
    pairs = [(1e-3, 0), (1e-2, 1)]
    train_runs(seed_members(tmp_path, pairs, "train.epochs=1"))
    ref_root = set_aside(tmp_path)
    summaries = train_runs(seed_members(tmp_path, pairs, "train.epochs=1", "train.compile=true"))
    for summary in summaries:
        assert_same_run(ref_root / summary["run"], tmp_path / "default" / summary["run"], 1e-5, config=False)


def test_zoo_train_pack_lrs_writes_one_run_per_lr(tmp_path, capsys):
    main([*TINY, f"runs_root={tmp_path}", "model=attention", "train.epochs=1", "train.pack_lrs=[1e-3,1e-2]"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["lr=0.001", "lr=0.01"]
    for lr in ("1e-3", "1e-2"):
        cfg, _ = cfg_of(tmp_path, "model=attention", "train.epochs=1", f"optim.lr={lr}")
        assert RunDir(tmp_path / "default" / run_name(cfg)).is_finished()


@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_every_naive_mixer_packs_under_bf16_autocast(mixer):
    """What a GPU pack runs (train.precision auto = bf16 autocast), here on the CPU's autocast: each member's loss
    equals the plain model's under the same autocast (the vmapped depthwise conv once failed there on its fp32
    bias)."""
    from zoo.device import autocast

    model, pack, inputs, query_pos, query_labels = tiny_pack(mixer)
    with autocast(torch.device("cpu"), "bf16"):
        losses = pack.losses(inputs, query_pos, query_labels)  # [2]
        loss = query_loss(model, inputs, query_pos, query_labels)
    losses.sum().backward()
    assert torch.isfinite(pack.flat.grad).all()
    for member in range(2):
        torch.testing.assert_close(losses[member].float(), loss.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("model", ["attention", "based"])
def test_captured_step_path_equals_standalone_runs(tmp_path, model):
    """train.cuda_graph=true: the static-buffer step (device scalars for the lr factor and step count, batch
    indices copied into a fixed buffer) trains each member exactly as its standalone run. On CPU the same path
    runs without the graph; tests/test_packed_gpu.py replays the captured graph against it on CUDA."""
    extra = (f"model={model}", "train.epochs=2", "train.early_stop=null")
    refs = [standalone(tmp_path, lr, *extra) for lr in LRS[:2]]
    ref_root = set_aside(tmp_path)
    got = packed(tmp_path, LRS[:2], *extra, "train.cuda_graph=true")
    assert [s["run"] for s in got] == [s["run"] for s in refs]
    for s in refs:
        assert_same_run(ref_root / s["run"], tmp_path / "default" / s["run"], config=False)


def test_a_pack_that_disagrees_with_its_plain_model_fails_before_training(tmp_path, monkeypatch):
    """The runtime agreement check: a vmap rule that computes something else (here: a scaled loss) stops the
    pack with a one-line PackError before any run dir is written, and zoo-sweep then trains the runs unpacked."""
    from zoo.jobs import run_pack

    original = _Pack._member_loss
    monkeypatch.setattr(_Pack, "_member_loss", lambda self, *args: 1.5 * original(self, *args))
    cfg, _ = cfg_of(tmp_path, "model=attention", "train.epochs=1")
    with pytest.raises(PackError, match="disagrees with the plain one"):
        train_runs(pack_members(cfg, LRS[:2]))
    assert not (tmp_path / "default").exists()
    runs = [[*TINY, "model=attention", "train.epochs=1", f"optim.lr={lr}", f"runs_root={tmp_path}"] for lr in LRS[:2]]
    records = run_pack(runs, [])
    assert [r["status"] for r in records] == ["finished", "finished"]
    assert all("disagrees" in r["unpacked"] for r in records)


class _FailingBackward(torch.autograd.Function):
    """Identity forward; a backward that raises, as a vmapped backward with no rule for a dtype does on the GPU."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("expected input and grad types to match\nsecond line")


def test_a_pack_whose_vmapped_backward_raises_trains_unpacked(tmp_path, monkeypatch):
    """The H200's sliding-window pack raised in its vmapped backward (bf16 autocast): that is a one-line PackError
    before any run dir is written, and zoo-sweep then trains the runs unpacked instead of failing them."""
    from zoo.jobs import run_pack

    original = _Pack.losses
    monkeypatch.setattr(_Pack, "losses", lambda self, *a, **kw: _FailingBackward.apply(original(self, *a, **kw)))
    cfg, _ = cfg_of(tmp_path, "model=attention", "train.epochs=1")
    with pytest.raises(PackError) as e:
        train_runs(pack_members(cfg, LRS[:2]))
    assert "the vmapped model fails" in one_line(e) and "expected input and grad types to match" in one_line(e)
    assert not (tmp_path / "default").exists()
    runs = [[*TINY, "model=attention", "train.epochs=1", f"optim.lr={lr}", f"runs_root={tmp_path}"] for lr in LRS[:2]]
    records = run_pack(runs, [])
    assert [r["status"] for r in records] == ["finished", "finished"]
    assert all("fails" in r["unpacked"] for r in records)


def test_the_agreement_check_covers_every_member(tmp_path, monkeypatch):
    """A vmap rule that goes wrong for one member only (here: the second member's loss scaled) is caught too, not
    just a fault in the first row."""
    original = _Pack.losses

    def second_member_off(self, *args, **kwargs):
        losses = original(self, *args, **kwargs)
        return losses * torch.tensor([1.0] + [1.5] * (len(losses) - 1), device=losses.device)

    monkeypatch.setattr(_Pack, "losses", second_member_off)
    cfg, _ = cfg_of(tmp_path, "model=attention", "train.epochs=1")
    with pytest.raises(PackError, match="for member 1"):
        train_runs(pack_members(cfg, LRS[:2]))
    assert not (tmp_path / "default").exists()


FIG2_PRESETS = ["attention", "based", "base_conv", "rwkv", "hyena", "h3", "mamba"]


@pytest.mark.parametrize("preset", FIG2_PRESETS)
def test_paper_presets_with_dropout_train_as_a_pack(tmp_path, preset):
    """Every Zoology Fig. 2 model trains as a pack (`zoo-sweep --pack-lrs`; its L-long filters follow the data's
    length). The papers' models keep dropout (attention weights, embeddings): the pack draws each
    member's own masks (vmap randomness="different") and checks agreement with the plain model in eval mode."""
    one = "{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}"
    cfg, _ = load_config([*TINY, f"data.test=[{one}]", f"model=zoology_fig2/{preset}", f"runs_root={tmp_path}",
                          "train.epochs=1", "train.early_stop=null"])
    summaries = train_runs(pack_members(cfg, LRS[:2]))
    assert [s["pack_size"] for s in summaries] == [2, 2]
    assert all(0.0 <= s["test/accuracy"] <= 1.0 for s in summaries)


@pytest.mark.parametrize("clipped", [False, True])
def test_a_compiled_pack_compiles_its_adamw_update(clipped):
    """train.compile=true also compiles the pack's AdamW update (one fused pass over [N, P] on a GPU): one step
    equals the eager pack's, clipped or not."""
    torch.manual_seed(0)
    cfg, _ = load_config([*TINY, "model=based", f"optim.grad_clip={0.5 if clipped else 0.0}"])
    model = LanguageModel(cfg.model)
    packs = [_Pack(model, [1e-3, 2e-2], cfg.optim, total_steps=10, compile_mode=mode) for mode in (None, "default")]
    assert packs[1]._update is not packs[0]._update
    grad = torch.randn_like(packs[0].flat)
    for pack in packs:
        pack.flat.grad = grad.clone()
        for _ in range(2):
            pack.adamw_step(torch.tensor(0.7), torch.tensor(3.0))
    for eager, compiled in zip(*((p.flat, p.exp_avg, p.exp_avg_sq) for p in packs)):
        torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


class _StubRun:
    """A run dir that holds one checkpoint (or none)."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def load_checkpoint(self):
        return self.ckpt


@pytest.mark.parametrize("ckpts", [[{"epoch": 1, "step": 4}, {"epoch": 2, "step": 8}], [{"epoch": 1, "step": 4}, None]],
                         ids=["different-steps", "one-without"])
def test_a_pack_resumes_only_from_one_shared_checkpoint(ckpts):
    from zoo.train import _load_checkpoints

    with pytest.raises(PackError, match=r"stopped at different checkpoints \(a@1, b@"):
        _load_checkpoints([_StubRun(c) for c in ckpts], ["a", "b"], [0, 1], resume=True)


@pytest.mark.parametrize("resume", [True, False])
def test_a_pack_at_one_checkpoint_resumes_from_it(resume):
    from zoo.train import _load_checkpoints

    ckpt = {"epoch": 1, "step": 4}
    got = _load_checkpoints([_StubRun(ckpt), _StubRun(dict(ckpt))], ["a", "b"], [0, 1], resume=resume)
    assert got == ([ckpt, ckpt] if resume else [None, None])
