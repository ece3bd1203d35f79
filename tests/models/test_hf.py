"""The transformers wrappers: Auto* registration, save/load, and generate with the recurrent ZooCache.

Reference for every generation test: the LanguageModel recomputed over the whole sequence at each step.
"""

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import zoo  # noqa: F401  (registers model_type "zoo")
from zoo.models.cache import ZooCache
from zoo.models.hf import CACHE_KEY, ZooConfig, ZooForCausalLM

VOCAB = 64


def tiny(**overrides) -> ZooForCausalLM:
    """ZooConfig's default hybrid at a smaller vocab and a window of 4, so prompts overrun the ring."""
    torch.manual_seed(0)
    mixers = {"based": {"feature_dim": 4, "num_heads": 2}, "sliding_window": {"window": 4, "num_heads": 2}}
    config = ZooConfig(vocab_size=VOCAB, d_model=32, mixers=mixers, **overrides)
    model = ZooForCausalLM(config).eval()
    # Larger weights than the 0.02 init, so greedy tokens depend on the context and ties are unlikely.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model


def argmax_reference(model: ZooForCausalLM, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy tokens by full recomputation: prompt [T] -> [T + steps]."""
    seq = prompt[None]
    with torch.no_grad():
        for _ in range(steps):
            nxt = model.model(seq)[:, -1].argmax(-1)  # [1]
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    return seq[0]


def test_default_config_is_a_small_hybrid_with_all_three_layer_kinds():
    config = ZooConfig()
    assert {"base_conv", "sliding_window", "based"} <= set(config.model_config().layers())
    model = ZooForCausalLM(config)
    assert model.num_parameters() < 2_000_000


def test_auto_classes_know_zoo():
    config = AutoConfig.for_model("zoo", d_model=32, vocab_size=VOCAB)
    assert isinstance(config, ZooConfig)
    model = AutoModelForCausalLM.from_config(config)
    assert isinstance(model, ZooForCausalLM)


def test_invalid_config_fails_on_construction():
    with pytest.raises(ValueError, match="unknown mixer"):
        ZooConfig(pattern=["based", "mamba9"])


@pytest.mark.parametrize("pattern, kept", [(["attention", "sliding_window"], {"sliding_window"}),
                                           (["base_conv"], set())], ids=["keeps-the-window", "keeps-none"])
def test_a_pattern_of_ones_own_keeps_only_the_default_options_it_uses(pattern, kept):
    """ZooConfig's default options (Based, the window) must not make a config with another pattern invalid."""
    config = ZooConfig(vocab_size=VOCAB, d_model=32, n_layers=2, pattern=pattern)
    assert set(config.mixers) == kept
    assert ZooForCausalLM(config).model.config.layers() == pattern * (2 // len(pattern))


def test_options_given_for_a_mixer_off_the_pattern_fail():
    with pytest.raises(ValueError, match="never uses"):
        ZooConfig(pattern=["attention"], mixers={"based": {"feature_dim": 4}})


def test_save_load_round_trip(tmp_path):
    model = tiny(eos_token_id=5)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.embedding.weight" in keys and "model.head.weight" not in keys  # tied: stored once
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, ZooForCausalLM)
    assert loaded.model.head.weight is loaded.model.embedding.weight
    assert loaded.config.model_config() == model.config.model_config()
    assert loaded.config.eos_token_id == 5
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_untied_round_trip(tmp_path):
    model = tiny(tie_word_embeddings=False)
    assert model.model.head.weight is not model.model.embedding.weight
    model.save_pretrained(tmp_path)
    loaded = ZooForCausalLM.from_pretrained(tmp_path)
    assert loaded.model.head.weight is not loaded.model.embedding.weight
    assert torch.equal(loaded.model.head.weight, model.model.head.weight)


def test_greedy_generate_equals_argmax_over_full_recomputation():
    model = tiny()
    prompt = torch.randint(0, VOCAB, (11,))
    out = model.generate(prompt[None], max_new_tokens=20, do_sample=False)
    assert torch.equal(out[0], argmax_reference(model, prompt, 20))


@pytest.mark.parametrize("slice_tokens", [0, 7], ids=["whole-batch", "row-slices"])
def test_chunked_prefill_then_decode_equals_one_forward(slice_tokens):
    model = tiny(prefill_chunk_tokens=slice_tokens)
    ids = torch.randint(0, VOCAB, (3, 15))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = model.make_cache(3)
        a = model(ids[:, :6], cache=cache, use_cache=True).logits
        b = model(ids[:, 6:13], cache=cache, use_cache=True).logits
        c = model(ids[:, 13:14], cache=cache, use_cache=True).logits  # the single-token decode step
        d = model(ids[:, 14:], cache=cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat([a, b, c, d], dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 15


def test_state_memory_is_the_same_after_10_and_1000_tokens():
    model = tiny(pattern=["based", "sliding_window", "base_conv"], n_layers=3, mlp="none")  # all three, fast steps
    prompt = torch.randint(0, VOCAB, (2, 5))
    caches = []
    for n in (10, 1000):
        out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, return_dict_in_generate=True)
        assert out.sequences.shape[1] == 5 + n
        caches.append(getattr(out, CACHE_KEY))
    short, long = caches
    assert isinstance(long, ZooCache) and long.get_seq_length() == 5 + 1000 - 1  # the last token is never fed back
    assert long.nbytes() == short.nbytes()
    assert [t.shape for t in long.tensors()] == [t.shape for t in short.tensors()]
    floating = sum(t.numel() * t.element_size() for t in long.tensors() if t.is_floating_point())
    assert floating == 2 * 4 * model.model.state_size(1005)  # batch 2, fp32: exactly the mixers' fixed states


def test_decode_updates_the_cache_in_place():
    model = tiny()
    ids = torch.randint(0, VOCAB, (2, 6))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        cache = getattr(out, CACHE_KEY)
        before = [(t.data_ptr(), t.clone()) for t in cache.tensors()]
        model(ids[:, :1], cache=cache, use_cache=True)
    for (ptr, _), t in zip(before, cache.tensors()):
        assert t.data_ptr() == ptr
    assert any(not torch.equal(old, t) for (_, old), t in zip(before, cache.tensors()))


def left_pad(prompts: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    T = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), T), pad_id)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = p
        mask[i, T - len(p) :] = 1
    return ids, mask


@pytest.mark.parametrize("pattern", [None, ["attention", "based"]], ids=["hybrid", "attention"])
def test_left_padded_batch_equals_each_sequence_alone(pattern):
    if pattern is None:
        model = tiny()
    else:
        model = ZooForCausalLM(ZooConfig(vocab_size=VOCAB, d_model=32, pattern=pattern, n_layers=2, mixers={})).eval()
    pad = 0
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in (3, 12, 7, 12)]
    ids, mask = left_pad(prompts, pad)
    kwargs = dict(max_new_tokens=9, do_sample=False, pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
    batch = model.generate(ids, attention_mask=mask, **kwargs)
    for i, p in enumerate(prompts):
        alone = model.generate(p[None], **kwargs)
        assert torch.equal(batch.sequences[i, ids.shape[1] :], alone.sequences[0, len(p) :]), f"row {i}"
        for step, (s_batch, s_alone) in enumerate(zip(batch.scores, alone.scores)):
            torch.testing.assert_close(s_batch[i], s_alone[0], rtol=1e-4, atol=1e-4, msg=f"row {i} step {step}")


def test_prefill_in_row_slices_equals_one_batched_prefill():
    model = tiny()
    ids, mask = left_pad([torch.randint(1, VOCAB, (n,)) for n in (3, 12, 7, 12, 5)], 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    whole = model.generate(ids, output_scores=True, return_dict_in_generate=True, **kwargs)
    model.config.prefill_chunk_tokens = 2 * ids.shape[1]  # slices of two rows
    sliced = model.generate(ids, output_scores=True, return_dict_in_generate=True, **kwargs)
    assert torch.equal(sliced.sequences, whole.sequences)
    for a, b in zip(sliced.scores, whole.scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        last = model(ids[1:2], use_cache=True, logits_to_keep=3).logits
        full = model(ids[1:2], use_cache=False).logits
    torch.testing.assert_close(last, full[:, -3:], rtol=1e-5, atol=1e-5)


def test_forward_with_left_padding_and_no_cache_matches_unpadded():
    model = tiny()
    prompts = [torch.randint(1, VOCAB, (n,)) for n in (4, 9)]
    ids, mask = left_pad(prompts, 0)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, use_cache=False).logits
        for i, p in enumerate(prompts):
            torch.testing.assert_close(logits[i, -len(p) :], model(p[None], use_cache=False).logits[0])


def test_generate_without_cache_recomputes_the_same_tokens():
    model = tiny()
    ids, mask = left_pad([torch.randint(1, VOCAB, (n,)) for n in (3, 8)], 0)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kwargs), model.generate(ids, use_cache=False, **kwargs))
    beams = model.generate(ids, num_beams=3, **kwargs)  # reorders the cache's rows between steps
    assert beams.shape == (2, ids.shape[1] + 6)


def test_right_padding_is_refused():
    model = tiny()
    ids = torch.randint(1, VOCAB, (2, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with pytest.raises(ValueError, match="left-padded"):
        model.generate(ids, attention_mask=mask, max_new_tokens=2, pad_token_id=0)


def test_eos_stops_a_row_and_pads_it():
    model = tiny()
    prompt = torch.randint(0, VOCAB, (1, 6))
    free = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, 6:]
    eos = int(free[3])
    first = int((free == eos).nonzero()[0])
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=VOCAB - 1)[0, 6:]
    assert torch.equal(out[: first + 1], free[: first + 1])
    assert out.shape[0] == first + 1  # a single row stops right at eos


@pytest.mark.parametrize("kwargs", [{"top_k": 5}, {"top_p": 0.8}, {"temperature": 0.7}], ids=["top_k", "top_p", "temp"])
def test_sampling_is_seeded_and_follows_its_filter(kwargs):
    model = tiny()
    prompt = torch.randint(0, VOCAB, (3, 4))
    torch.manual_seed(123)
    a = model.generate(prompt, max_new_tokens=15, do_sample=True, **kwargs)
    torch.manual_seed(123)
    b = model.generate(prompt, max_new_tokens=15, do_sample=True, **kwargs)
    assert torch.equal(a, b)
    greedy = model.generate(prompt, max_new_tokens=15, do_sample=False)
    assert not torch.equal(a, greedy)  # sampling at these settings leaves the argmax path somewhere in 45 tokens
    torch.manual_seed(7)
    top1 = model.generate(prompt, max_new_tokens=15, do_sample=True, top_k=1)
    assert torch.equal(top1, greedy)


def test_labels_give_the_shifted_next_token_loss():
    model = tiny()
    ids = torch.randint(0, VOCAB, (2, 8))
    labels = ids.clone()
    labels[0, :3] = -100
    out = model(ids, labels=labels, use_cache=False)
    logits = model.model(ids)
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager():
    model = tiny().cuda()
    prompt = torch.randint(0, VOCAB, (4, 9), device="cuda")
    model.config.decode_cuda_graph = False
    eager = model.generate(prompt, max_new_tokens=30, do_sample=False, output_scores=True, return_dict_in_generate=True)
    model.config.decode_cuda_graph = True
    graph = model.generate(prompt, max_new_tokens=30, do_sample=False, output_scores=True, return_dict_in_generate=True)
    assert getattr(graph, CACHE_KEY).decode_graph is not None
    assert torch.equal(graph.sequences, eager.sequences)
    for s_graph, s_eager in zip(graph.scores, eager.scores):
        torch.testing.assert_close(s_graph, s_eager)


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager_over_1024_tokens_with_triton_kernels():
    """The bench's decode path (experiments/bench/generation.py): bf16, Based, the window and BaseConv on their Triton
    kernels, a CUDA graph per step. 1,024 greedy tokens equal the eager path's, token for token: a state the graph
    advanced differently at any step would change every later token."""
    torch.manual_seed(0)
    mixers = {"based": {"feature_dim": 16, "num_heads": 2, "impl": "triton"},
              "sliding_window": {"window": 64, "num_heads": 2, "impl": "triton"}, "base_conv": {"impl": "triton"}}
    model = ZooForCausalLM(ZooConfig(vocab_size=512, d_model=128, mixers=mixers)).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)  # as tiny(): greedy tokens depend on the context
    model.to(torch.bfloat16)
    prompt = torch.randint(0, 512, (4, 32), device="cuda")
    kwargs = {"max_new_tokens": 1024, "min_new_tokens": 1024, "do_sample": False, "pad_token_id": 0}
    model.config.decode_cuda_graph = False
    eager = model.generate(prompt, **kwargs)
    model.config.decode_cuda_graph = True
    graph = model.generate(prompt, **kwargs, return_dict_in_generate=True)
    assert getattr(graph, CACHE_KEY).decode_graph is not None
    assert graph.sequences.shape == (4, 32 + 1024)
    assert torch.equal(graph.sequences, eager)
    assert eager[:, 32:].unique().numel() > 50  # not a loop of a few tokens: the state keeps steering the argmax


@pytest.mark.slow  # a subprocess that imports torch and transformers and builds two models
def test_generation_benchmark_runs_tiny_on_cpu():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "experiments" / "bench" / "generation.py"
    cmd = [sys.executable, str(script), "--tiny", "--device", "cpu", "--prompt", "8", "--gen", "4"]
    # the script's own directory comes first on its path; this checkout's packages next, before any installed copy
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert {r["model"] for r in last["rows"]} == {"based", "llama"}
    assert all(r["decode_tokens_per_s"] > 0 for r in last["rows"])
    assert abs(last["params"]["based"] - last["params"]["llama"]) / last["params"]["based"] < 0.15
    assert last["based_tok_s"] > 0 and last["llama_tok_s"] > 0 and last["decode_frac_copy_bw"] > 0
    assert last["prefill_ratio_batch1"] > 0 and last["prefill_batch_common"] == 2
    for kind in ("based", "llama"):
        best = max((r for r in last["rows"] if r["model"] == kind), key=lambda r: r["decode_tokens_per_s"])
        assert (last[f"{kind}_prefill_batch_best"], last[f"{kind}_prefill_ms_best"]) == (best["batch"],
                                                                                      best["prefill_ms"])
    assert last["prefill_ratio_best_per_seq"] > 0
    assert last["graph_eager_check"] is None  # no CUDA graph on the CPU
    profile = last["decode_profile"]
    parts = {r["part"]: r for r in profile["parts"]}
    # based_tiny: every layer kind of based_1b, each part charged its own time and bytes
    assert {"embedding", "norm", "mlp", "head", "mixer based", "mixer sliding_window", "mixer base_conv"} <= set(parts)
    assert all(r["ms"] > 0 and r["MB"] > 0 for name, r in parts.items() if name != "embedding")
    assert sum(r["layers"] for name, r in parts.items() if name.startswith("mixer")) == parts["norm"]["layers"]
    kernels = profile["kernels"]  # on the CPU: the costliest aten ops
    assert 0 < len(kernels) <= 15 and not profile["kernels_are_device"]
    assert all(k["name"].startswith("aten::") and k["calls_per_step"] > 0 for k in kernels)
    assert [k["ms"] for k in kernels] == sorted((k["ms"] for k in kernels), reverse=True)
    assert 0 < sum(k["share"] for k in kernels) <= 1 + 1e-9
