"""Greedy generation from left-padded prompts through ZooForCausalLM (BaseConv, Based and the sliding window), for
the tests that hold a decoding kernel against the PyTorch step at the level of generated tokens."""

import torch


def generate_left_padded(mixers: dict):
    """`generate` (8 greedy tokens, scores returned) for three left-padded prompts of 3, 9 and 6 tokens, on a tiny
    model with `mixers` (ZooConfig's mixer options) and weights larger than the init, so that the greedy tokens depend
    on the context. The window (16) is longer than the prompts, so it reaches the padding."""
    from zoo.models.hf import ZooConfig, ZooForCausalLM

    torch.manual_seed(0)
    lm = ZooForCausalLM(ZooConfig(vocab_size=64, d_model=32, mixers=mixers)).eval()
    with torch.no_grad():
        for p in lm.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 64, (n,), generator=g) for n in (3, 9, 6)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return lm.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                       output_scores=True, return_dict_in_generate=True)


def assert_same_generation(naive, fast) -> None:
    assert torch.equal(fast.sequences, naive.sequences)
    for a, b in zip(fast.scores, naive.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
