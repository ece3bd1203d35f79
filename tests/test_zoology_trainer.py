"""Zoology's trainer and init as options (zoo/config.py): the lr held through each epoch on a per-epoch cosine
(`optim.schedule=cosine_epoch`), weight decay on every parameter (`optim.decay=all`) and Zoology's init
(`model.init=zoology`), in the plain and the packed loop; a committed summary still names its point when a model
field it predates is left at its default."""

import math

import pytest
import torch

from zoo.config import ModelConfig, OptimConfig
from zoo.models import LanguageModel
from zoo.runs import point_key
from zoo.steps import PackedParams, build_optimizer, lr_lambda
from zoo.train import ConfigError, load_config, train

TINY = [
    "model=based",
    "model.d_model=16",
    "data.vocab_size=64",
    "data.train=[{seq_len:16,num_kv_pairs:2,num_examples:64,batch_size:16}]",
    "data.valid=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
    "data.test=[{seq_len:16,num_kv_pairs:2,num_examples:32,batch_size:32}]",
    "optim.warmup_frac=0",
    "optim.schedule=cosine_epoch",
    "train.epochs=4",
    "train.early_stop=null",
    "train.log_every=1",
    "train.progress=false",
]


def test_cosine_epoch_is_torchs_cosine_annealing_stepped_each_epoch():
    epochs, per_epoch = 5, 7
    f = lr_lambda(OptimConfig(lr=1.0, warmup_frac=0.0, schedule="cosine_epoch"), epochs * per_epoch, epochs)
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs, eta_min=0.0)
    opt.step()  # torch warns when a scheduler steps before its optimizer
    for epoch in range(epochs):
        want = opt.param_groups[0]["lr"]
        got = [f(epoch * per_epoch + i) for i in range(per_epoch)]
        assert got == pytest.approx([want] * per_epoch, abs=1e-12), epoch
        sched.step()


def test_cosine_epoch_keeps_min_lr_ratio():
    f = lr_lambda(OptimConfig(warmup_frac=0.0, min_lr_ratio=0.1, schedule="cosine_epoch"), 40, 4)
    assert f(0) == pytest.approx(1.0)
    assert f(39) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))


@pytest.mark.parametrize("kwargs,match", [
    ({"schedule": "cosine_epoch", "warmup_frac": 0.02}, "cosine_epoch has no warmup"),
    ({"schedule": "linear"}, "optim.schedule must be one of cosine|cosine_epoch"),
    ({"decay": "biases"}, "optim.decay must be one of matrices|all"),
])
def test_bad_optim_options_fail_in_one_line(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        OptimConfig(**kwargs)
    assert "\n" not in str(err.value)


def test_cosine_epoch_needs_an_epoch_count():
    with pytest.raises(ConfigError, match="needs an epoch count"):
        lr_lambda(OptimConfig(warmup_frac=0.0, schedule="cosine_epoch"), 100)


def test_a_run_logs_one_lr_an_epoch(tmp_path):
    cfg, resolved = load_config([*TINY, f"runs_root={tmp_path}", "optim.lr=0.01"])
    summary = train(cfg, resolved)
    from zoo.runs import RunDir

    logged = [(m["epoch"], m["lr"]) for m in RunDir(tmp_path / "default" / summary["run"]).read_metrics()
              if "lr" in m]
    by_epoch = {}
    for epoch, lr in logged:
        by_epoch.setdefault(epoch, set()).add(round(lr, 12))
    # the lr a step trained at is logged after it: the 4 steps of epoch e log epoch e's lr
    assert sorted(by_epoch) == [0, 1, 2, 3]
    for epoch, lrs in by_epoch.items():
        assert lrs == {round(0.01 * 0.5 * (1 + math.cos(math.pi * epoch / 4)), 12)}, epoch


def _model(init: str, pattern=("short_conv", "attention"), d: int = 256) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(ModelConfig(d_model=d, vocab_size=64, pattern=list(pattern), init=init))


def test_zoology_init_rescales_out_proj_and_keeps_conv_biases():
    default, zoology = _model("default"), _model("zoology")
    conv_d, conv_z = default.blocks[0].mixer.conv, zoology.blocks[0].mixer.conv
    assert torch.count_nonzero(conv_d.bias) == 0
    assert conv_z.bias.abs().max() > 0.1  # PyTorch's U(±1/sqrt(k)) with k = 3
    assert conv_z.bias.abs().max() <= 1 / math.sqrt(conv_z.kernel_size[0]) + 1e-6
    assert default.blocks[1].mixer.out.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert zoology.blocks[1].mixer.out.weight.std().item() == pytest.approx(0.02 / 2, rel=0.03)  # 0.02/sqrt(2·2)
    # Zoology rescales the modules it names out_proj only: Based's output (its proj_o) keeps 0.02
    based = _model("zoology", ("short_conv", "based"))
    assert based.blocks[1].mixer.out.weight.std().item() == pytest.approx(0.02, rel=0.03)


def test_bad_init_fails_in_one_line():
    with pytest.raises(ValueError, match="model.init must be one of default|zoology"):
        ModelConfig(init="xavier")


def test_decay_all_decays_biases_and_norms_in_both_loops():
    model = _model("default", d=16)
    for decay, want_free in (("matrices", True), ("all", False)):
        cfg, _ = load_config([f"optim.decay={decay}"])
        groups = build_optimizer(model, cfg).param_groups
        free = [p for g in groups if g["weight_decay"] == 0.0 for p in g["params"]]
        assert bool(free) == want_free
        assert all(p.ndim < 2 for p in free)
        pack = PackedParams(model, [1e-3, 1e-2], cfg.optim, total_steps=10)
        n_free = sum(p.numel() for p in free)
        assert int((pack.decay == 0).sum()) == n_free
        assert int((pack.decay == cfg.optim.weight_decay).sum()) == pack.decay.numel() - n_free


def test_a_pack_trains_as_its_members_alone_under_zoologys_trainer(tmp_path):
    from test_packed import assert_same_run, set_aside

    from zoo.steps import pack_members
    from zoo.train import train_runs

    extra = ["optim.decay=all", "model.init=zoology", "train.epochs=2", "train.log_every=2"]
    lrs = [1e-3, 3e-2]
    refs = []
    for lr in lrs:
        cfg, resolved = load_config([*TINY, f"runs_root={tmp_path}", f"optim.lr={lr}", *extra])
        refs.append(train(cfg, resolved))
    ref_root = set_aside(tmp_path)
    cfg, _ = load_config([*TINY, f"runs_root={tmp_path}", *extra])
    got = train_runs(pack_members(cfg, lrs))
    assert [s["run"] for s in got] == [s["run"] for s in refs]
    for s in refs:
        assert_same_run(ref_root / s["run"], tmp_path / "default" / s["run"])


def test_a_summary_from_before_a_model_field_names_the_same_point():
    cfg, resolved = load_config(["model=zoology_fig2/attention"])
    import yaml

    model = yaml.safe_load(resolved)["model"]
    before = {k: v for k, v in model.items() if k != "init"}  # as collected before model.init existed
    assert point_key("e", before, 1e-3, 0, 64) == point_key("e", model, 1e-3, 0, 64)
    assert point_key("e", before, 1e-3, 0, 64) != point_key("e", model | {"init": "zoology"}, 1e-3, 0, 64)


def test_zoology_init_gives_each_rwkv4_layer_zoologys_values():
    d = 64
    c = torch.arange(d, dtype=torch.float32)
    default, zoology = (_model(init, ("rwkv4",), d=d) for init in ("default", "zoology"))
    for m in default.blocks:  # layer 0's values in every layer
        torch.testing.assert_close(m.mixer.time_decay.data, -5 + 8 * (c / (d - 1)) ** 0.7)
        torch.testing.assert_close(m.mixer.time_mix_k.data, c / d)
    first, second = (b.mixer for b in zoology.blocks)
    torch.testing.assert_close(first.time_decay.data, default.blocks[0].mixer.time_decay.data)
    a, b = 1 / 11, 1 - 1 / 12  # Zoology's layer 1 of RWKV-4's default 12
    torch.testing.assert_close(second.time_decay.data, -5 + 8 * (c / (d - 1)) ** (0.7 + 1.3 * a))
    torch.testing.assert_close(second.time_mix_k.data, (c / d) ** b)
    torch.testing.assert_close(second.time_mix_v.data, (c / d) ** b + 0.3 * a)
    torch.testing.assert_close(second.time_mix_r.data, (c / d) ** (0.5 * b))


def test_zoology_init_leaves_rwkv4_projections_at_torch_default():
    """Zoology's scripted RWKVTimeMixer hides its Linears from its normal(0.02) init: U(±1/√d), std 1/√(3d)."""
    d = 256
    default, zoology = (_model(init, ("rwkv4",), d=d) for init in ("default", "zoology"))
    for name in ("key", "value", "receptance", "output"):
        for mixers, want in (((b.mixer for b in default.blocks), 0.02), ((b.mixer for b in zoology.blocks), None)):
            for m in mixers:
                w = getattr(m, name).weight
                if want is None:
                    assert w.abs().max() <= 1 / math.sqrt(d)
                    want_std = 1 / math.sqrt(3 * d)
                else:
                    want_std = want
                assert w.std().item() == pytest.approx(want_std, rel=0.05), name


def test_tanh_mlp_is_zoologys_2023_state_mixer():
    """mlp=tanh: fc2(tanh(fc1(x))) of width 4d with biases, after its own norm and residual; model.init=zoology
    draws fc2 at 0.02/sqrt(2 n_layers) like `out_proj`, fc1 at 0.02, biases at 0."""
    d = 256
    cfg = ModelConfig(d_model=d, vocab_size=64, pattern=["attention"], mlp="tanh", init="zoology")
    torch.manual_seed(0)
    model = LanguageModel(cfg)
    plain = LanguageModel(ModelConfig(d_model=d, vocab_size=64, pattern=["attention"], mlp="none", init="zoology"))
    assert model.num_parameters() - plain.num_parameters() == 2 * (d * 4 * d + 4 * d + 4 * d * d + d + 2 * d)
    mlp = model.blocks[1].mlp
    assert mlp.fc2.weight.std().item() == pytest.approx(0.02 / 2, rel=0.05)
    assert mlp.fc1.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.count_nonzero(mlp.fc1.bias) == 0 and torch.count_nonzero(mlp.fc2.bias) == 0
    x = torch.randn(3, d)
    torch.testing.assert_close(mlp(x), mlp.fc2(torch.tanh(mlp.fc1(x))))


def test_rwkv4_init_layers_sets_the_schedule_zoology_init_follows():
    """init_layers=2 (the published figure's launch): layer 1 takes a = 1, b = 1/2."""
    d = 64
    c = torch.arange(d, dtype=torch.float32)
    cfg = ModelConfig(d_model=d, vocab_size=64, pattern=["rwkv4"], init="zoology", mixers={"rwkv4": {"init_layers": 2}})
    second = LanguageModel(cfg).blocks[1].mixer
    torch.testing.assert_close(second.time_decay.data, -5 + 8 * (c / (d - 1)) ** 2.0)
    torch.testing.assert_close(second.time_mix_k.data, (c / d) ** 0.5)
    torch.testing.assert_close(second.time_mix_v.data, (c / d) ** 0.5 + 0.3)
    torch.testing.assert_close(second.time_mix_r.data, (c / d) ** 0.25)


def test_final_norm_sets_the_norm_before_the_head_alone():
    from zoo.models.hf import ZooConfig

    cfg = ModelConfig(d_model=32, vocab_size=64, pattern=["mamba"], norm="rmsnorm", final_norm="layernorm")
    model = LanguageModel(cfg)
    assert isinstance(model.norm, torch.nn.LayerNorm)
    assert all(isinstance(b.mixer_norm, torch.nn.RMSNorm) for b in model.blocks)
    assert isinstance(LanguageModel(ModelConfig(d_model=32, vocab_size=64, norm="rmsnorm")).norm, torch.nn.RMSNorm)
    assert ZooConfig.from_model_config(cfg).model_config().final_norm == "layernorm"
    with pytest.raises(ValueError, match="model.final_norm must be empty"):
        ModelConfig(final_norm="batchnorm")


def test_hyena_zoology_positions_and_short_conv_init():
    from zoo.models.mixers import MIXERS

    L = 32
    torch.manual_seed(0)
    hyena = MIXERS["hyena"](16, max_seq_len=L, num_freqs=1, positions="zoology", short_bias=True, learn_freq=True)
    pos = torch.arange(L, dtype=torch.float32)
    w = 2 * math.pi * pos / L
    want = torch.stack([pos / (L - 1), torch.cos(1e-4 * w), -torch.sin(1e-4 * w)], dim=-1)
    torch.testing.assert_close(hyena.filter.z.data, want)
    assert isinstance(hyena.filter.z, torch.nn.Parameter)  # learned, as Zoology's
    torch.testing.assert_close(hyena.filter.t[:, 0], pos / (L - 1))
    # the filter, written out: the MLP reads z, the decay reads t = position / (L-1)
    f = hyena.filter
    with torch.no_grad():
        x = want
        for linear in f.hidden:
            x = torch.sin(f.freq * linear(x))
        expected = f.head(x) * torch.exp(-f.decay[None, :] * (pos / (L - 1))[:, None])
        torch.testing.assert_close(f(L), expected)
    model = LanguageModel(ModelConfig(d_model=16, vocab_size=64, pattern=["hyena"], init="zoology",
                                      mixers={"hyena": {"max_seq_len": L, "short_bias": True}}))
    for block in model.blocks:
        bound = 1 / math.sqrt(block.mixer.k)
        for p in (block.mixer.short_weight, block.mixer.short_bias):
            assert p.abs().max() <= bound and p.abs().max() > 0.8 * bound and p.std() < 0.75 * bound
    with pytest.raises(ValueError, match="positions=zoology needs num_freqs >= 1"):
        MIXERS["hyena"](16, num_freqs=0, positions="zoology")


def test_h3_zoology_ssm_is_s4d_lin_bilinear():
    """H3 with ssm=zoology reduced to its SSM (q = v = 1, the shift an identity, out = identity): each channel is
    Zoology's S4D-Lin kernel, 2·Re(Σ_m C_m dB_m dA_m^l) with bilinear dA, dB, plus D at lag 0; written out here from
    the raw parameters as a recurrence over a complex state."""
    from zoo.models.mixers import MIXERS

    d, N, T = 4, 6, 12
    torch.manual_seed(0)
    h3 = MIXERS["h3"](d, d_state=N, shift_size=3, ssm="zoology").double()
    M = N // 2
    torch.testing.assert_close(h3.inv_A_real.data, torch.full((d, M), math.log(0.5), dtype=torch.float64))
    torch.testing.assert_close(h3.A_imag.data, math.pi * torch.arange(M, dtype=torch.float64).repeat(d, 1))
    with torch.no_grad():
        h3.qkv.weight.zero_()
        h3.qkv.weight[d : 2 * d] = torch.eye(d)  # k = x
        h3.qkv.bias.zero_()
        h3.qkv.bias[:d] = 1.0  # q = 1
        h3.qkv.bias[2 * d :] = 1.0  # v = 1
        h3.shift_weight.zero_()
        h3.shift_weight[:, -1] = 1.0  # the current input: k' = k
        h3.shift_skip.zero_()
        h3.out.weight.copy_(torch.eye(d))
        h3.out.bias.zero_()
    x = torch.randn(2, T, d, dtype=torch.float64)
    with torch.no_grad():
        got = h3(x)
        dt = torch.exp(h3.log_dt)[:, None]
        A = -torch.exp(h3.inv_A_real) + 1j * h3.A_imag
        B = torch.complex(h3.B[..., 0], h3.B[..., 1])
        C = torch.complex(h3.C[..., 0], h3.C[..., 1])
        dA, dB = (2 + dt * A) / (2 - dt * A), 2 * dt * B / (2 - dt * A)
        s = torch.zeros(2, d, M, dtype=torch.complex128)
        want = []
        for t in range(T):
            s = dA * s + dB * x[:, t, :, None]
            want.append(2 * (C * s).sum(-1).real + h3.D * x[:, t])
        torch.testing.assert_close(got, torch.stack(want, dim=1))


def test_h3_zoology_shift_skip_and_init():
    from zoo.models.mixers import MIXERS

    with pytest.raises(ValueError, match="d_state must be even"):
        MIXERS["h3"](8, d_state=5, ssm="zoology")
    model = LanguageModel(ModelConfig(d_model=64, vocab_size=64, pattern=["h3"], init="zoology",
                                      mixers={"h3": {"d_state": 16, "shift_size": 16, "head_dim": 2,
                                                     "ssm": "zoology"}}))
    for block in model.blocks:
        w = block.mixer.shift_weight
        assert w.abs().max() <= 1 / 4 and w.abs().max() > 0.2  # U(±1/√16), Zoology's SSKernelShift C
        assert block.mixer.shift_skip.std() > 0.5  # its ssm_k_D ~ N(0, 1)


@pytest.mark.parametrize("at", ["init", "trained"])
def test_h3_zoology_shift_filter_is_b_correlated_with_the_taps(at):
    """ssm=zoology: Zoology's shift SSM filters k with h[l] = Σ_n B_n C_{n+l} (B trainable, e₁ at init, so h = C)."""
    from zoo.models.mixers import MIXERS

    d, k = 6, 5
    h3 = MIXERS["h3"](d, d_state=4, shift_size=k, head_dim=2, ssm="zoology").double()
    assert h3.shift_b.requires_grad and h3.shift_b.shape == (d, k)
    if at == "trained":
        with torch.no_grad():
            h3.shift_b.normal_()
    c_lag = h3.shift_weight.detach().flip(1)  # c_lag[:, l]: the tap on the input l steps back
    b = h3.shift_b.detach()
    h = torch.stack([sum(b[:, n] * c_lag[:, n + lag] for n in range(k - lag)) for lag in range(k)], dim=1)
    torch.testing.assert_close(h3._shift_filter().detach(), h.flip(1))
    x = torch.randn(2, 7, d, dtype=torch.float64, requires_grad=True)
    h3(x).sum().backward()
    assert h3.shift_b.grad is not None and h3.shift_b.grad.abs().sum() > 0
