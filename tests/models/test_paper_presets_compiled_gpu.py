"""The paper presets with the fast paths their sweeps take on the GPU (Triton scans, FLA), trained as the sweeps
train them (`train.compile=true` compiles the whole query loss, model included): the compiled loss and every
parameter's gradient equal the eager ones. A kernel that torch.compile traces wrongly (rather than calls as an
opaque op) shows here as a wrong gradient, before a sweep spends hours on it. Needs CUDA."""

import glob
import runpy
from pathlib import Path

import pytest
import torch

from zoo.eval import query_loss
from zoo.models.lm import LanguageModel
from zoo.train import load_config

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(
    p[len(str(REPO / "zoo/configs/model")) + 1 : -5] for p in glob.glob(str(REPO / "zoo/configs/model/*_fig2/*.yaml"))
)
# The GPU implementations that experiments/zoology_fig2 and experiments/based_frontier select.
# The Zoology Fig. 2 sweep's exact settings from the L = 128 panel on (its ZOOLOGY_EXACT, model keys only, and
# ZOOLOGY_EXACT_MIXER): Zoology's init, the final LayerNorm, Hyena's position features and H3's complex SSM.
_FIG2 = runpy.run_path(str(REPO / "experiments/zoology_fig2/sweep.py"))
EXACT = {
    f"zoology_fig2/{mixer}": [
        f"{k}={v}" for k, v in (_FIG2["ZOOLOGY_EXACT"] | _FIG2["ZOOLOGY_EXACT_MIXER"].get(mixer, {})).items()
        if k.lstrip("+").startswith("model.")
    ]
    for mixer in _FIG2["MIXERS"]
}
CASES = [(name, []) for name in PRESETS] + [(name, overrides) for name, overrides in EXACT.items()]
FAST_PATHS = {
    "mamba": ("mamba", "triton"),
    "rwkv": ("rwkv4", "triton"),
    "gla": ("gla", "fla"),
    "gated_deltanet": ("gated_deltanet", "chunk"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name, exact", CASES, ids=[name + ("+exact" if exact else "") for name, exact in CASES])
def test_compiled_loss_and_gradients_equal_eager(name, exact):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    preset = name.split("/")[1]
    extra = list(exact)
    if preset in FAST_PATHS:
        mixer, impl = FAST_PATHS[preset]
        if impl == "fla":
            pytest.importorskip("fla")
        extra.append(f"+model.mixers.{mixer}.impl={impl}")
    L, d, batch, n = 64, 64, 16, 4
    seg = f"{{seq_len: {L}, num_kv_pairs: {n}, num_examples: 8, batch_size: 8}}"
    splits = [f"data.{s}=[{seg}]" for s in ("train", "valid", "test")]
    cfg, _ = load_config([f"model={name}", "data=mqar_zoology", f"model.d_model={d}", *splits, *extra])
    torch.manual_seed(0)
    lm = LanguageModel(cfg.model).cuda()
    lm.eval()  # no dropout: both calls see the same function
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, L), device="cuda", generator=g)
    pos = torch.arange(L // 2, L, 2, device="cuda").expand(batch, -1).contiguous()
    labels = torch.randint(0, cfg.model.vocab_size, pos.shape, device="cuda", generator=g)
    results = []
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    # every case compiles query_loss afresh: in one process the cases would otherwise fill dynamo's cache for it
    # (8 graphs) and the later ones would compare eager with eager
    torch.compiler.reset()
    try:
        for fn in (query_loss, torch.compile(query_loss, dynamic=False)):
            lm.zero_grad(set_to_none=True)
            loss = fn(lm, ids, pos, labels)
            loss.backward()
            results.append((loss.detach(), {k: p.grad.clone() for k, p in lm.named_parameters() if p.grad is not None}))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    (loss0, grads0), (loss1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-4, atol=1e-5)
    assert grads1.keys() == grads0.keys()
    for k, g0 in grads0.items():
        err = float((grads1[k] - g0).norm() / g0.norm().clamp_min(1e-12))
        assert err < 1e-3, f"{k}: compiled gradient differs from eager by {err:.2e} (relative norm)"
