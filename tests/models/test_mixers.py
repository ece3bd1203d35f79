"""Protocol invariants of every registered mixer: forward == step loop, chunked prefill == full forward,
state_size == real state, causality, in-place state, option checking."""

import math

import pytest
import torch

from kernels.based.naive import feature_dim
from zoo.models.mixers import MIXERS, check_mixer_options

D_MODEL = 16

# (id, mixer name, options): small shapes that still reach every code path (several naive Based chunks,
# windows shorter than the chunks, conv kernels longer than some chunks).
CASES = [
    ("attention-rotary", "attention", {"num_heads": 2}),
    ("attention-learned", "attention", {"num_heads": 2, "positional": "learned"}),
    ("attention-nopos", "attention", {"positional": "none"}),
    ("sliding_window-w4", "sliding_window", {"window": 4, "num_heads": 2}),
    ("sliding_window-w1", "sliding_window", {"window": 1}),
    ("sliding_window-zoology", "sliding_window", {"window": 5, "num_heads": 1, "rotary": False, "bias": True}),
    ("based-f4h2", "based", {"feature_dim": 4, "num_heads": 2, "chunk_size": 5}),
    ("based-f3dv5", "based", {"feature_dim": 3, "head_dim_v": 5}),
    ("base_conv-k3", "base_conv", {}),
    ("base_conv-k4e1", "base_conv", {"kernel_size": 4, "expand": 1}),
    ("base_conv-k1", "base_conv", {"kernel_size": 1}),  # no history at all
    ("hyena", "hyena", {"filter_hidden": 8, "num_freqs": 2}),
    ("hyena-k2", "hyena", {"filter_hidden": 8, "short_kernel_size": 2}),
    ("hyena-zoology", "hyena", {"filter_hidden": 8, "num_freqs": 0, "filter_depth": 2, "learn_freq": True,
                                "short_bias": True}),
    ("hyena-zoology-positions", "hyena", {"filter_hidden": 8, "num_freqs": 1, "positions": "zoology",
                                          "filter_depth": 2, "learn_freq": True, "short_bias": True}),
    ("h3-n8", "h3", {"d_state": 8}),
    ("h3-n3-shift2", "h3", {"d_state": 3, "shift_size": 2}),
    ("h3-p2", "h3", {"d_state": 4, "head_dim": 2}),
    ("h3-p4-shift40", "h3", {"d_state": 3, "head_dim": 4, "shift_size": 40}),  # a shift filter via causal_conv
    ("h3-zoology", "h3", {"d_state": 6, "head_dim": 2, "shift_size": 6, "ssm": "zoology"}),
    ("short_conv-k3", "short_conv", {}),
    ("short_conv-k5", "short_conv", {"kernel_size": 5}),
    ("short_conv-k1", "short_conv", {"kernel_size": 1}),
    ("long_conv", "long_conv", {}),
    ("long_conv-h4b3", "long_conv", {"filter_hidden": 4, "num_bands": 3}),
    ("long_conv-explicit", "long_conv", {"filter": "explicit"}),
    ("rwkv4-c8", "rwkv4", {}),
    ("rwkv4-c16", "rwkv4", {"chunk_size": 16}),
    ("rwkv4-c5", "rwkv4", {"chunk_size": 5}),
    ("rwkv4-c1", "rwkv4", {"chunk_size": 1}),
    ("mamba-n4", "mamba", {"d_state": 4}),
    ("mamba-e1-k2", "mamba", {"d_state": 3, "expand": 1, "conv_size": 2, "dt_rank": 2}),
    ("mamba-c5", "mamba", {"d_state": 4, "chunk_size": 5}),
    ("mamba-loop", "mamba", {"d_state": 4, "chunk_size": 0}),
    ("mamba2-p8-c5", "mamba2", {"d_state": 4, "head_dim": 8, "chunk_size": 5}),
    ("mamba2-e1", "mamba2", {"d_state": 6, "expand": 1, "head_dim": 4, "conv_size": 3, "chunk_size": 8}),
    ("linear_attention-performer", "linear_attention", dict(feature_map="performer", feature_dim=4, num_features=6)),
    ("linear_attention-cosformer", "linear_attention", {"feature_map": "cosformer", "feature_dim": 4, "num_heads": 2}),
    ("linear_attention-pos_elu", "linear_attention", {"feature_map": "pos_elu", "feature_dim": 5, "chunk_size": 5}),
    ("linear_attention-relu", "linear_attention", {"feature_map": "relu", "feature_dim": 6, "head_dim_v": 3}),
    ("linear_attention-hedgehog", "linear_attention", {"feature_map": "hedgehog", "feature_dim": 4, "num_features": 5}),
    ("linear_attention-taylor", "linear_attention", {"feature_map": "taylor", "feature_dim": 3, "num_heads": 2}),
    ("gla-h2", "gla", {"num_heads": 2}),
    ("gla-dk3", "gla", {"head_dim_k": 3, "head_dim_v": 5}),
    ("deltanet-h2", "deltanet", {"num_heads": 2}),
    ("gated_deltanet-h2", "gated_deltanet", {"num_heads": 2}),
    ("deltanet-chunk5", "deltanet", {"num_heads": 2, "impl": "chunk", "chunk_size": 5}),
    ("gated_deltanet-chunk4", "gated_deltanet", {"impl": "chunk", "chunk_size": 4}),
    ("gated_deltanet-chunk64", "gated_deltanet", {"num_heads": 2, "impl": "chunk"}),
    ("rwkv-h2", "rwkv", {"num_heads": 2}),
    ("rwkv-h1", "rwkv", {"decay_rank": 3}),
]
CASE_IDS = [case[0] for case in CASES]


def build(case, max_seq_len: int = 64, seed: int = 0) -> torch.nn.Module:
    """The mixer of a case in float64; attention gets a KV buffer of max_seq_len rows."""
    _, name, options = case
    options = dict(options)
    if name in ("attention", "hyena", "long_conv"):
        options["max_seq_len"] = max_seq_len
    torch.manual_seed(seed)
    return MIXERS[name](D_MODEL, **options).double()


def inputs(batch: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, T, D_MODEL, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def state_tensors(state) -> list[torch.Tensor]:
    return [] if state is None else list(state.values())


def test_every_registered_mixer_has_a_case():
    assert {name for _, name, _ in CASES} == set(MIXERS)


@pytest.mark.parametrize("T", [1, 7, 33], ids=lambda T: f"T{T}")
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_equals_step_loop(case, T):
    mixer = build(case)
    x = inputs(2, T)
    with torch.no_grad():
        full = mixer(x)
        state = mixer.init_state(2)
        steps = torch.stack([mixer.step(x[:, t], state) for t in range(T)], dim=1)
    torch.testing.assert_close(steps, full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("splits", [(5, 28), (16, 17), (1, 31, 1), (9, 9, 15)], ids=lambda s: "+".join(map(str, s)))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_chunks_with_state_equal_full_forward(case, splits):
    mixer = build(case)
    x = inputs(2, sum(splits))
    with torch.no_grad():
        full = mixer(x)
        state = mixer.init_state(2)
        parts = [mixer(chunk, state) for chunk in torch.split(x, list(splits), dim=1)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_prefill_then_decode_equals_full_forward(case):
    mixer = build(case)
    x = inputs(3, 30)
    with torch.no_grad():
        full = mixer(x)
        state = mixer.init_state(3)
        prefill = mixer(x[:, :11], state)
        decoded = [mixer.step(x[:, t], state) for t in range(11, 30)]
    torch.testing.assert_close(torch.cat([prefill, torch.stack(decoded, dim=1)], dim=1), full, rtol=1e-9, atol=1e-10)


def expected_state_size(case, T: int) -> int:
    """REFERENCE §1 / DESIGN formulas, written out from the options; the long convolutions are built with
    max_seq_len = T, the rows their buffers hold."""
    _, name, options = case
    d = D_MODEL
    if name == "attention":
        return 2 * T * d
    if name == "sliding_window":
        return 2 * options["window"] * d
    if name == "based":
        H, E = options.get("num_heads", 1), feature_dim(options["feature_dim"])
        dv = options.get("head_dim_v", d // H)
        return H * (E * dv + E)
    if name == "base_conv":
        return options.get("expand", 2) * d * (options.get("kernel_size", 3) - 1)
    if name == "hyena":
        return d * T + 3 * d * (options.get("short_kernel_size", 3) - 1)
    if name == "h3":
        return options.get("head_dim", 1) * d * options["d_state"] + d * (options.get("shift_size", 4) - 1)
    if name == "short_conv":
        return d * (options.get("kernel_size", 3) - 1)
    if name == "long_conv":
        return d * T
    if name == "rwkv4":
        return 4 * d
    if name == "mamba":
        d_inner = options.get("expand", 2) * d
        return d_inner * options["d_state"] + d_inner * (options.get("conv_size", 4) - 1)
    if name == "mamba2":
        d_inner, N = options.get("expand", 2) * d, options["d_state"]
        return d_inner * N + (d_inner + 2 * N) * (options.get("conv_size", 4) - 1)
    if name == "linear_attention":
        H, f, m = options.get("num_heads", 1), options["feature_dim"], options.get("num_features", 32)
        E = {"performer": m, "cosformer": 2 * f, "pos_elu": f, "relu": f, "hedgehog": 2 * m, "taylor": feature_dim(f)}
        dv = options.get("head_dim_v", d // H)
        return H * (E[options["feature_map"]] * dv + E[options["feature_map"]])
    if name in ("gla", "deltanet", "gated_deltanet", "rwkv"):
        H = options.get("num_heads", 1)  # default_num_heads(16) is 1
        dk = options.get("head_dim_k", d // (2 * H) if name == "gla" else d // H)
        dv = options.get("head_dim_v", d // H)
        return H * dk * dv + (d if name == "rwkv" else 0)
    raise AssertionError(f"no formula for {name}")


@pytest.mark.parametrize("T", [1, 33], ids=lambda T: f"T{T}")
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_state_size_counts_the_real_state(case, T):
    batch = 3
    mixer = build(case, max_seq_len=T)
    state = mixer.init_state(batch)
    with torch.no_grad():
        mixer(inputs(batch, T), state)
    floating = [t for t in state_tensors(state) if t.is_floating_point()]
    counters = [t for t in state_tensors(state) if not t.is_floating_point()]
    assert all(t.shape[0] == batch for t in floating)
    assert all(t.dtype == torch.int64 for t in counters)
    real = sum(t.numel() for t in floating) // batch
    assert mixer.state_size(T) == real
    assert mixer.state_size(T) == expected_state_size(case, T)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_causal(case):
    mixer = build(case)
    x = inputs(2, 13)
    t = 6
    x_changed = x.clone()
    x_changed[:, t] += 1.0
    with torch.no_grad():
        y, y_changed = mixer(x), mixer(x_changed)
    torch.testing.assert_close(y_changed[:, :t], y[:, :t], rtol=0, atol=1e-12)
    assert not torch.allclose(y_changed[:, t], y[:, t])


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_state_is_updated_in_place(case):
    mixer = build(case)
    state = mixer.init_state(2)
    before = {key: (t.data_ptr(), t.shape, t.clone()) for key, t in state.items()}
    with torch.no_grad():
        mixer(inputs(2, 5), state)
        mixer.step(inputs(2, 1)[:, 0], state)
    assert set(state) == set(before)
    for key, (ptr, shape, old) in before.items():
        assert state[key].data_ptr() == ptr and state[key].shape == shape, key
        if old.numel():  # an empty state (a kernel-1 conv's history) has nothing to change
            assert not torch.equal(state[key], old), f"state[{key!r}] never changed"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_reach_every_parameter(case):
    mixer = build(case)
    mixer(inputs(2, 9)).square().sum().backward()
    for name, param in mixer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_defaults_build_and_run(name):
    mixer = MIXERS[name](d_model=64)
    y = mixer(torch.randn(2, 5, 64))
    assert y.shape == (2, 5, 64) and torch.isfinite(y).all()
    assert isinstance(mixer.config, MIXERS[name].Config)


BAD_OPTIONS = [
    ("unknown-mixer", "retnet", {}, r"unknown mixer 'retnet' \(known: attention, sliding_window, based, base_conv, hy"),
    ("typo", "based", {"feture_dim": 8}, r"mixer 'based' has no option 'feture_dim' \(options: feature_dim, "),
    ("heads-not-dividing", "attention", {"num_heads": 3}, "divisible by num_heads=3"),
    ("odd-rotary-head", "attention", {"num_heads": 16}, "even head dim"),
    ("positional", "attention", {"positional": "alibi"}, "rotary|learned|none"),
    ("max_seq_len", "attention", {"max_seq_len": 0}, "max_seq_len must be >= 1"),
    ("window-0", "sliding_window", {"window": 0}, "window must be >= 1"),
    ("window-str", "sliding_window", {"window": "64"}, "window must be an int"),
    ("swa-heads", "sliding_window", {"num_heads": 5}, "divisible by num_heads=5"),
    ("feature_dim-0", "based", {"feature_dim": 0}, "feature_dim must be >= 1"),
    ("based-heads", "based", {"num_heads": 3}, "divisible by num_heads=3"),
    ("impl", "based", {"impl": "cuda"}, "naive|fla|triton"),
    ("eps", "based", {"eps": -1.0}, "eps must be a float >= 0"),
    ("fla-feature_dim", "based", {"impl": "fla", "feature_dim": 129}, "feature_dim <= 128"),
    ("kernel_size", "base_conv", {"kernel_size": 0}, "kernel_size must be >= 1"),
    ("expand", "base_conv", {"expand": 0}, "expand must be >= 1"),
    ("hyena-decay", "hyena", {"decay_min": 5.0, "decay_max": 1.0}, "decay_min=5.0 exceeds decay_max=1.0"),
    ("h3-d_state", "h3", {"d_state": 0}, "d_state must be >= 1"),
    ("h3-head_dim", "h3", {"head_dim": 3}, "divisible by head_dim=3"),
    ("short_conv-k0", "short_conv", {"kernel_size": 0}, "kernel_size must be >= 1"),
    ("long_conv-bands", "long_conv", {"num_bands": 0}, "num_bands must be >= 1"),
    ("long_conv-len", "long_conv", {"max_seq_len": 0}, "max_seq_len must be >= 1"),
    ("long_conv-filter", "long_conv", {"filter": "mlp"}, "filter must be implicit or explicit, got 'mlp'"),
    ("rwkv4-chunk", "rwkv4", {"chunk_size": 0}, "chunk_size must be >= 1"),
    ("rwkv4-impl", "rwkv4", {"impl": "torch"}, "naive|triton"),
    ("attention-dropout", "attention", {"dropout": 1.0}, r"dropout must be a number in \[0, 1\)"),
    ("attention-bias", "attention", {"bias": 1}, "bias must be true or false"),
    ("mamba-dt", "mamba", {"dt_min": 0.5, "dt_max": 0.1}, "0 < dt_min <= dt_max"),
    ("mamba2-head_dim", "mamba2", {"head_dim": 5}, "divisible by head_dim=5"),
    ("feature_map", "linear_attention", {"feature_map": "softmax"}, "performer|cosformer|pos_elu|relu|hedgehog|taylor"),
    ("gla-impl", "gla", {"impl": "triton"}, "naive|fla"),
    ("deltanet-heads", "deltanet", {"num_heads": 3}, "divisible by num_heads=3"),
    ("deltanet-impl", "deltanet", {"impl": "cuda"}, "must be one of"),
    ("gated_deltanet-chunk", "gated_deltanet", {"impl": "chunk", "chunk_size": 0}, "chunk_size"),
    ("rwkv-rank", "rwkv", {"decay_rank": 0}, "decay_rank must be >= 1"),
]


@pytest.mark.parametrize(("name", "options", "message"), [b[1:] for b in BAD_OPTIONS], ids=[b[0] for b in BAD_OPTIONS])
def test_bad_options_raise_value_error(name, options, message):
    with pytest.raises(ValueError, match=message):
        check_mixer_options(name, D_MODEL, options)
    if name in MIXERS:
        with pytest.raises(ValueError, match=message):
            MIXERS[name](D_MODEL, **options)


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_bad_shapes_raise_value_error(name):
    mixer = MIXERS[name](D_MODEL)
    with pytest.raises(ValueError, match=f"shape \\[B, T>=1, {D_MODEL}\\]"):
        mixer(torch.randn(2, 3, D_MODEL + 1))
    with pytest.raises(ValueError, match=f"shape \\[B, {D_MODEL}\\]"):
        mixer.step(torch.randn(2, 1, D_MODEL), mixer.init_state(2))


def test_attention_state_overflow_raises():
    mixer = build(CASES[0], max_seq_len=8)
    state = mixer.init_state(1)
    mixer(inputs(1, 6), state)
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        mixer(inputs(1, 3), state)


def test_attention_matches_plain_softmax_reference():
    """Rotary-free attention against softmax(q k^T/√D + causal mask) v written out here."""
    mixer = build(CASES[2])
    x = inputs(2, 9)
    with torch.no_grad():
        q, k, v = (t.reshape(2, 9, D_MODEL) for t in (x @ mixer.qkv.weight.T).chunk(3, dim=-1))
        scores = q @ k.transpose(1, 2) / math.sqrt(D_MODEL)
        scores = scores.masked_fill(torch.ones(9, 9).triu(1).bool(), float("-inf"))
        expected = (scores.softmax(-1) @ v) @ mixer.out.weight.T
        torch.testing.assert_close(mixer(x), expected, rtol=1e-10, atol=1e-12)


def test_sliding_window_matches_banded_reference():
    """Window w: token i sees exactly keys max(0, i-w+1)..i; compare to full attention on that slice."""
    window = 4
    mixer = build(CASES[3])
    x = inputs(1, 11)
    with torch.no_grad():
        y = mixer(x)
        # Rotary is relative, so attention over the slice ending at i, re-positioned from 0, gives the same row.
        for i in range(11):
            start = max(0, i - window + 1)
            torch.testing.assert_close(y[:, i], mixer(x[:, start : i + 1])[:, -1], rtol=1e-9, atol=1e-10)


def test_sliding_window_without_rotary_is_zoologys_sliding_attn():
    """Zoology's SlidingAttn with block_size w: one head over d, biased qkv and output projections, no positions,
    and a mask that keeps keys i-w..i (w + 1 of them), so it is our window of w + 1 with rotary=False, bias=True."""
    w, T = 3, 10
    mixer = build(("", "sliding_window", {"window": w + 1, "num_heads": 1, "rotary": False, "bias": True}))
    with torch.no_grad():
        for p in (mixer.qkv.bias, mixer.out.bias):
            p.normal_(generator=torch.Generator().manual_seed(4))
    x = inputs(2, T)
    with torch.no_grad():
        q, k, v = (x @ mixer.qkv.weight.T + mixer.qkv.bias).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(D_MODEL)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        scores = scores.masked_fill((j > i) | (j < i - w), float("-inf"))
        expected = (scores.softmax(-1) @ v) @ mixer.out.weight.T + mixer.out.bias
        torch.testing.assert_close(mixer(x), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 4, 7, 64])
def test_mamba_chunked_scan_equals_the_loop(chunk):
    """Mamba's chunked prefix scan against the plain loop over time (fp64, T=29, so chunks of 4 and 7 leave a
    partial last chunk): outputs and final state from a random initial state, and every gradient."""
    loop = build(("", "mamba", {"d_state": 5, "chunk_size": 0}))
    chunked = build(("", "mamba", {"d_state": 5, "chunk_size": chunk}))
    chunked.load_state_dict(loop.state_dict())
    x = inputs(2, 29)
    outs, grads = [], []
    for mixer in (loop, chunked):
        state = mixer.init_state(2)
        state["ssm"].normal_(generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            outs.append((mixer(x, state), state["ssm"]))
        xi = x.clone().requires_grad_()
        mixer(xi).square().sum().backward()
        grads.append([xi.grad, *(p.grad for p in mixer.parameters())])
    for a, b in [*zip(outs[0], outs[1]), *zip(grads[0], grads[1])]:
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["deltanet", "gated_deltanet"])
@pytest.mark.parametrize(("T", "chunk"), [(1, 4), (15, 4), (64, 16), (100, 64), (37, 37)])
def test_chunked_delta_rule_equals_the_token_loop(name, T, chunk):
    """impl=chunk's recurrence (`_chunk`) against the token loop (`_naive_token`, the specification) on the same
    inputs: outputs, the final state and the gradients reaching x, the initial state and every parameter, with
    T not a multiple of the chunk. The decays are made strong (Gated DeltaNet's A_log raised) so that the
    within-chunk ratios e^{γ_t-γ_j} span several orders of magnitude."""
    torch.manual_seed(0)
    mixer = MIXERS[name](D_MODEL, num_heads=2, impl="chunk", chunk_size=chunk).double()
    if name == "gated_deltanet":
        with torch.no_grad():
            mixer.A_log.add_(2.0)
    x = torch.randn(2, T, D_MODEL, dtype=torch.float64)
    S0 = torch.randn(2, 2, D_MODEL // 2, D_MODEL // 2, dtype=torch.float64)
    weights = torch.linspace(-1, 1, D_MODEL // 2, dtype=torch.float64)
    results = []
    for chunked in (False, True):
        xi, S = x.clone().requires_grad_(True), S0.clone().requires_grad_(True)
        inp, _ = mixer._inputs(xi, None)
        if chunked:
            o, S_end = mixer._chunk(inp, S)
        else:
            outs, S_end = [], S
            for i in range(T):
                o_t, S_end = mixer._naive_token(S_end, {key: t[:, i] for key, t in inp.items()})
                outs.append(o_t)
            o = torch.stack(outs, dim=1)
        loss = (o * weights).square().sum() + (S_end * S_end.detach().sign()).sum()
        grads = torch.autograd.grad(loss, [xi, S, *mixer.parameters()], materialize_grads=True)
        results.append((o, S_end, grads))
    (o0, s0, g0), (o1, s1, g1) = results
    torch.testing.assert_close(o1, o0, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s1, s0, rtol=1e-10, atol=1e-12)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_long_conv_matches_a_direct_sum_and_reaches_every_lag():
    """long_conv's convolution against y = (Σ_{s≤t} h[t-s] u_s + u_t) ⊙ proj(u_t) + u_t summed directly, and the
    input at position 0 reaches the output at the filter's last lag (max_seq_len - 1)."""
    T = 24
    mixer = build(("", "long_conv", {}), max_seq_len=T)
    with torch.no_grad():
        for p in mixer.filter.parameters():
            p.normal_(generator=torch.Generator().manual_seed(4))
    x = inputs(2, T)
    h = mixer.filter(T)  # [T, d]
    assert h.shape == (T, D_MODEL)
    conv = torch.stack([sum(h[t - s] * x[:, s] for s in range(t + 1)) for t in range(T)], dim=1)
    expected = (conv + x) * mixer.projection(x) + x
    torch.testing.assert_close(mixer(x), expected, rtol=1e-10, atol=1e-12)
    xi = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(mixer(xi)[:, T - 1].sum(), xi)
    assert grad[:, 0].abs().sum() > 0


def test_long_conv_explicit_filter_is_zoologys_free_taps():
    """filter=explicit: h is the taps parameter itself ([max_seq_len, d], the only filter parameter), drawn
    N(0, 1) as Zoology's LongConvolution draws it, left so by the model's init; the convolution then equals the
    direct sum with those taps."""
    from zoo.models.lm import _init_weights

    T = 24
    mixer = build(("", "long_conv", {"filter": "explicit"}), max_seq_len=T)
    filter_params = dict(mixer.filter.named_parameters())
    assert list(filter_params) == ["taps"] and filter_params["taps"].shape == (T, D_MODEL)
    wide = MIXERS["long_conv"](256, max_seq_len=512, filter="explicit")
    before = wide.filter.taps.detach().clone()
    wide.apply(_init_weights)
    assert torch.equal(wide.filter.taps, before)
    assert abs(before.std().item() - 1.0) < 0.01 and abs(before.mean().item()) < 0.01
    x = inputs(2, T)
    h = mixer.filter(T)
    assert h.data_ptr() == mixer.filter.taps.data_ptr()
    conv = torch.stack([sum(h[t - s] * x[:, s] for s in range(t + 1)) for t in range(T)], dim=1)
    torch.testing.assert_close(mixer(x), (conv + x) * mixer.projection(x) + x, rtol=1e-10, atol=1e-12)


def test_long_conv_longer_than_its_filter_raises():
    mixer = build(("", "long_conv", {}), max_seq_len=8)
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        mixer(inputs(1, 9))


def wkv_reference(w: torch.Tensor, u: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """RWKV-4's WKV written as the paper's equation, exponentials taken directly (fp64, small k).
    w, u: [d]; k, v: [B, T, d] -> [B, T, d]."""
    T = k.shape[1]
    out = []
    for t in range(T):
        num, den = torch.exp(u + k[:, t]) * v[:, t], torch.exp(u + k[:, t])
        for i in range(t):
            weight = torch.exp((t - 1 - i) * w + k[:, i])
            num, den = num + weight * v[:, i], den + weight
        out.append(num / den)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("chunk", [1, 4, 16], ids=lambda c: f"chunk{c}")
def test_rwkv4_matches_the_wkv_equation(chunk):
    mixer = build(("", "rwkv4", {"chunk_size": chunk}))
    x = inputs(2, 11)
    with torch.no_grad():
        sr, k, v = mixer._inputs(x, x.new_zeros(2, D_MODEL))
        w = -torch.exp(mixer.time_decay)
        expected = mixer.output(sr * wkv_reference(w, mixer.time_first, k, v))
        torch.testing.assert_close(mixer(x), expected, rtol=1e-10, atol=1e-12)


def test_rwkv4_stays_finite_where_direct_exponentials_overflow():
    """Keys of size ~10^3 overflow e^k even in fp64; the max-normalised forms stay finite and agree."""
    mixer = build(("", "rwkv4", {"chunk_size": 4}))
    with torch.no_grad():
        mixer.key.weight.mul_(3000.0)
        x = inputs(2, 19)
        full = mixer(x)
        state = mixer.init_state(2)
        steps = torch.stack([mixer.step(x[:, t], state) for t in range(19)], dim=1)
    assert torch.isfinite(full).all()
    torch.testing.assert_close(steps, full, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", ["hyena", "long_conv"])
def test_long_convolution_state_size_is_the_buffer_held(name):
    """The decode buffer holds max_seq_len rows from the start, so state_size reports them at every seq_len."""
    mixer = build(("", name, {}), max_seq_len=40)
    state = mixer.init_state(3)
    with torch.no_grad():
        mixer(inputs(3, 5), state)
    real = sum(t.numel() for t in state.values() if t.is_floating_point()) // 3
    assert mixer.state_size(1) == mixer.state_size(5) == real
