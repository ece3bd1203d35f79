"""Distillation invariants: the loss vanishes for the chunk's exact KV, packing isolates examples."""

import pytest
import torch

from cartridges.cache import Cartridge
from cartridges.clients import TransformersClient
from cartridges.config import DistillConfig
from cartridges.corpus import context_ids, turn_ids
from cartridges.distill import collate, conversation_examples, distill_loss, learning_rate, pack
from zoo.pretrained import ByteTokenizer, tiny_llama

CHUNK = "The lighthouse of Vellmar was lit in 1843 by Ines Okafor, who kept it for forty-one years."


@pytest.fixture(scope="module")
def setup():
    model, tok = tiny_llama(seed=0), ByteTokenizer()
    ctx = context_ids(tok, CHUNK)
    client = TransformersClient(model, tok)
    questions = ["Who lit it?", "When was the lighthouse lit, and by whom?", "Kept how long?"]
    turns = [turn_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]
    answers = client.complete([ctx + t for t in turns], max_tokens=12, temperature=0.0, top_logprobs=5)
    rows = [
        {"input_ids": t + a.token_ids, "answer_start": len(t), "top_ids": a.top_ids, "top_logprobs": a.top_logprobs}
        for t, a in zip(turns, answers)
    ]
    return model, tok, ctx, rows


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_loss_is_zero_for_the_exact_chunk_kv(setup, attn):
    _, _, ctx, rows = setup
    model = tiny_llama(seed=0)  # the fixture's weights, with the attention kernel under test
    model.set_attn_implementation(attn)  # the packed 4D mask must mean the same to both
    examples = conversation_examples(rows, "self_study")
    packs = pack(examples, pack_len=10_000)
    assert len(packs) == 1 and len(packs[0]) == 3  # all three examples share one packed row
    exact = Cartridge.from_prefix(model, torch.tensor(ctx))
    batch = collate(packs, exact.num_tokens, model.dtype, "cpu")
    assert distill_loss(model, exact, batch).item() == pytest.approx(0.0, abs=1e-5)
    other = Cartridge.random(model, num_tokens=len(ctx), seed=0)
    assert distill_loss(model, other, batch).item() > 1e-2


def test_packing_matches_one_example_per_row(setup):
    model, _, ctx, rows = setup
    examples = conversation_examples(rows, "self_study")
    cartridge = Cartridge.random(model, num_tokens=len(ctx), seed=1)
    packed = distill_loss(model, cartridge, collate(pack(examples, 10_000), cartridge.num_tokens, model.dtype, "cpu"))
    # Unpacked: one row per example, padded; the mean over all target tokens must agree.
    unpacked = distill_loss(
        model, cartridge, collate([[e] for e in examples], cartridge.num_tokens, model.dtype, "cpu")
    )
    torch.testing.assert_close(packed, unpacked, rtol=1e-5, atol=1e-6)


def test_hard_labels_loss_is_cross_entropy(setup):
    model, _, ctx, rows = setup
    examples = conversation_examples(rows[:1], "hard_labels")
    cartridge = Cartridge.from_prefix(model, torch.tensor(ctx))
    loss = distill_loss(model, cartridge, collate([examples], cartridge.num_tokens, model.dtype, "cpu"))
    # cross-entropy of the greedy tokens under the full-context model, computed directly
    ids = torch.tensor([ctx + rows[0]["input_ids"]])
    logits = model(input_ids=ids).logits[0].log_softmax(-1)
    start = len(ctx) + rows[0]["answer_start"]
    targets = ids[0, start:]
    expected = -logits[start - 1 : -1].gather(1, targets[:, None]).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)


def test_collate_targets_equal_a_per_token_reference():
    """The vectorised targets (one tensor per example, built once) equal a per-token walk over the packed rows,
    with ragged top-k rows padded by probability-0 entries."""
    from cartridges.distill import Example

    examples = [
        Example([5, 6, 7, 8], [1, 2], [[7, 9], [8]], [[-0.1, -2.0], [0.0]]),
        Example([1, 2, 3], [0, 1, 2], [[2], [3, 4, 5], [0]], [[0.0], [-0.5, -1.0, -3.0], [0.0]]),
        Example([4, 4], [0], [[4]], [[0.0]]),
    ]
    batch = [[examples[0], examples[1]], [examples[2]]]
    got = collate(batch, num_prefix=3, dtype=torch.float32, device="cpu")
    k = 3
    rows, cols, top_ids, top_lp = [], [], [], []
    for b, row in enumerate(batch):
        offset = 0
        for ex in row:
            for p, ti, tl in zip(ex.positions, ex.top_ids, ex.top_logprobs):
                rows.append(b)
                cols.append(offset + p)
                top_ids.append(ti + [0] * (k - len(ti)))
                top_lp.append(tl + [float("-inf")] * (k - len(tl)))
            offset += len(ex.ids)
    assert got["rows"].tolist() == rows and got["cols"].tolist() == cols
    assert got["top_ids"].tolist() == top_ids
    assert torch.equal(got["top_logprobs"], torch.tensor(top_lp, dtype=torch.float32))
    assert got["input_ids"].tolist() == [[5, 6, 7, 8, 1, 2, 3], [4, 4, 0, 0, 0, 0, 0]]
    assert got["position_ids"].tolist() == [[3, 4, 5, 6, 3, 4, 5], [3, 4, 3, 3, 3, 3, 3]]
    allowed = got["attention_mask"][:, 0] == 0  # [B, T, p + T]
    assert allowed[:, :, :3].all()  # every token sees the cartridge
    assert allowed[0, 5, 3 + 4] and not allowed[0, 5, 3 + 3]  # own example only, across the packed boundary
    assert not allowed[0, 4, 3 + 5]  # causal


def _kl_of(model, cartridge, rows) -> torch.Tensor:
    from cartridges.distill import student_logprobs, tail_kl

    batch = collate(pack(conversation_examples(rows, "self_study"), 10_000), cartridge.num_tokens, model.dtype, "cpu")
    return tail_kl(student_logprobs(model, cartridge, batch), batch)


def test_true_kl_is_zero_for_the_exact_chunk_kv(setup):
    model, _, ctx, rows = setup
    kl = _kl_of(model, Cartridge.from_prefix(model, torch.tensor(ctx)), rows)
    assert kl.min() >= 0 and kl.max().item() == pytest.approx(0.0, abs=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_true_kl_is_positive_for_other_cartridges(setup, seed):
    model, _, ctx, rows = setup
    kl = _kl_of(model, Cartridge.random(model, num_tokens=len(ctx), seed=seed), rows)
    assert kl.min() >= 0 and kl.mean() > 1e-2


@pytest.mark.parametrize("k", [1, 3, 20])
def test_true_kl_stays_nonnegative_where_the_topk_loss_goes_negative(k):
    """A student that puts more mass than the teacher on the teacher's top-k makes the training objective
    negative; the tail-bucket KL stays ≥ 0 and equals the KL of the two (k + 1)-outcome distributions."""
    from cartridges.distill import tail_kl, topk_kl

    gen = torch.Generator().manual_seed(k)
    teacher = (torch.randn(64, 50, generator=gen) * 2).log_softmax(-1)
    top = teacher.topk(k, dim=-1)
    student = teacher.clone()
    student.scatter_(1, top.indices, top.values + 1.0)  # [N, V] more mass on the top-k
    student = student.log_softmax(-1)
    batch = {"top_ids": top.indices, "top_logprobs": top.values}
    assert topk_kl(student, batch) < 0
    kl = tail_kl(student, batch)
    p, q = top.values.double().exp(), student.gather(1, top.indices).double().exp()
    p = torch.cat([p, 1 - p.sum(-1, keepdim=True)], -1)
    q = torch.cat([q, 1 - q.sum(-1, keepdim=True)], -1)
    torch.testing.assert_close(kl.double(), (p * (p / q).log()).sum(-1), rtol=1e-4, atol=1e-6)
    assert kl.min() >= 0 and kl.mean() > 1e-3


@pytest.mark.parametrize("chunk", ["empty", "facts"])
def test_information_diagnostic(chunk):
    """The teacher-with-chunk vs model-without-it KL: ≈ 0 when the chunk is empty (both read the same context),
    > 0 when the answers depend on the chunk."""
    from cartridges.self_study import information_kl

    model, tok = tiny_llama(seed=0), ByteTokenizer()
    ctx = context_ids(tok, "" if chunk == "empty" else CHUNK)
    client = TransformersClient(model, tok)
    turns = [turn_ids(tok, [{"role": "user", "content": q}], add_generation_prompt=True) for q in ("Who?", "When?")]
    answers = client.complete([ctx + t for t in turns], max_tokens=10, temperature=0.0, top_logprobs=5)
    rows = [
        {"input_ids": t + a.token_ids, "answer_start": len(t), "top_ids": a.top_ids, "top_logprobs": a.top_logprobs}
        for t, a in zip(turns, answers)
    ]
    kl = information_kl(model, tok, rows)
    assert len(kl) == 2 and min(kl) >= 0
    if chunk == "empty":
        assert max(kl) == pytest.approx(0.0, abs=1e-5)
    else:
        assert min(kl) > 1e-2


@pytest.mark.parametrize(
    "schedule, expected",
    [("constant", [0.1, 0.1, 0.1, 0.1]), ("cosine", [0.1, 0.1 * (2 + 2**0.5) / 4, 0.05, 0.1 * (2 - 2**0.5) / 4])],
)
def test_learning_rate_schedule(schedule, expected):
    """The lr of each of 4 steps: constant, or a half cosine from lr at step 0 towards 0 after the last step."""
    cfg = DistillConfig(data="x", output="y", lr=0.1, steps=4, lr_schedule=schedule)
    assert [learning_rate(cfg, step) for step in range(4)] == pytest.approx(expected)


def test_unknown_lr_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_schedule"):
        DistillConfig(data="x", output="y", lr_schedule="linear")


def test_teacher_top_logprobs_are_the_models_distribution_at_each_answer_token(setup):
    """A record's top-k ids and log-probs at answer token j are the top k of log_softmax of the model's logits
    over the prompt and the first j answer tokens (what distillation matches the student against)."""
    model, tok, ctx, rows = setup
    for row in rows:
        ids = torch.tensor([ctx + row["input_ids"]])
        with torch.no_grad():
            logp = model(ids).logits[0].float().log_softmax(-1)  # [T, V]
        start = len(ctx) + row["answer_start"]
        for j, (top_ids, top_lp) in enumerate(zip(row["top_ids"], row["top_logprobs"])):
            want = logp[start + j - 1].topk(len(top_ids))
            assert top_ids == want.indices.tolist()
            torch.testing.assert_close(torch.tensor(top_lp), want.values, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def turn_rows(setup):
    """The fixture's conversations with the teacher's top-5 on their user turns (`turn_targets`)."""
    from cartridges.self_study import turn_targets

    model, _, ctx, rows = setup
    out = [dict(r) for r in rows]
    for r, (ids, lps) in zip(out, turn_targets(model, out, [ctx] * len(out), k=5)):
        r["turn_top_ids"], r["turn_top_logprobs"] = ids, lps
    return out


def test_turn_targets_equal_the_teacher_reading_chunk_and_turn(setup, turn_rows):
    """The naive twin: one forward pass over context + turn, top-5 of the log-softmax at the positions that predict
    the turn's tokens from its second on."""
    model, _, ctx, _ = setup
    for r in turn_rows:
        start = r["answer_start"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx + r["input_ids"][:start]])).logits[0].float()
        top = logits.log_softmax(-1)[len(ctx) : len(ctx) + start - 1].topk(5, dim=-1)
        assert len(r["turn_top_ids"]) == start - 1
        assert r["turn_top_ids"] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(r["turn_top_logprobs"]), top.values, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["self_study", "hard_labels"])
def test_conversation_targets_add_the_turn_before_the_answer(turn_rows, method):
    both = conversation_examples(turn_rows, method, targets="conversation")
    answers = conversation_examples(turn_rows, method)
    for r, full, ans in zip(turn_rows, both, answers):
        assert full.positions == list(range(len(r["input_ids"]) - 1))
        n = len(ans.positions)  # the answer's targets close the conversation's, unchanged
        assert full.positions[-n:] == ans.positions and full.top_ids[-n:] == ans.top_ids
        if method == "hard_labels":
            assert [t[0] for t in full.top_ids] == r["input_ids"][1:]


def test_conversation_loss_is_zero_for_the_exact_chunk_kv(setup, turn_rows):
    model, _, ctx, _ = setup
    batch = collate(pack(conversation_examples(turn_rows, "self_study", targets="conversation"), 10_000),
                    len(ctx), model.dtype, "cpu")
    exact = Cartridge.from_prefix(model, torch.tensor(ctx))
    assert distill_loss(model, exact, batch).item() == pytest.approx(0.0, abs=1e-5)
    assert distill_loss(model, Cartridge.random(model, num_tokens=len(ctx), seed=0), batch).item() > 1e-2


def test_conversation_targets_need_data_with_turn_targets(setup):
    from cartridges.config import ConfigError

    _, _, _, rows = setup
    with pytest.raises(ConfigError, match="turn_targets=true"):
        conversation_examples(rows, "self_study", targets="conversation")
