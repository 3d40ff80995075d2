"""Sampler unit tests: each filter against a direct computation, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.runtime.sampler import SamplingRow, sample
from kiln.runtime.sampling_params import SamplingParams


def _row(prompt=(1, 2), out=(), seed=None, **kw):
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**kw), list(prompt), list(out), g)


def _draws(logits, n=400, **kw):
    counts = torch.zeros(logits.shape[-1])
    for i in range(n):
        t = sample(logits.clone().unsqueeze(0), [_row(seed=i, **kw)]).token_ids[0]
        counts[t] += 1
    return counts / n


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    out = sample(logits.clone(), [_row(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_chunked_argmax_matches_argmax_with_ties_and_nan():
    """The two-pass greedy argmax (CUDA path of ``greedy_argmax``) picks what ``argmax`` picks:
    the first maximum when it repeats within a chunk and across chunks, a NaN when there is one."""
    from kiln.runtime.sampler import _argmax_chunk, _chunked_argmax

    assert _argmax_chunk(128256) == 501 * 2 and 128256 % _argmax_chunk(128256) == 0
    assert _argmax_chunk(49152) == 1024 and _argmax_chunk(1031) == 0  # a prime: one pass
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4096, generator=g)
    logits[1, [700, 701, 3000]] = 9.0  # tie within a chunk and across chunks: 700
    logits[2, [3000, 100]] = 9.0  # the later chunk written first: 100
    logits[3, 2048] = float("nan")
    logits[4] = 0.0  # all equal: 0
    logits[5, [4095, 4094]] = float("inf")
    for c in (128, 256, 512, 1024):
        got = _chunked_argmax(logits, c)
        assert got.tolist() == logits.argmax(-1).tolist() == [got[0].item(), 700, 100, 2048, 0, 4094], c


def test_top_k_only_keeps_k():
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    freq = _draws(logits, top_k=2, temperature=1.0)
    assert freq[2:].sum() == 0 and freq[0] > freq[1] > 0


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    freq = _draws(probs.log(), top_p=0.75, temperature=1.0)
    assert freq[2:].sum() == 0  # 0.5 + 0.3 >= 0.75: tokens 2 and 3 dropped
    assert freq[1] > 0.2


def test_min_p_drops_low_tokens():
    probs = torch.tensor([0.6, 0.3, 0.07, 0.03])
    freq = _draws(probs.log(), min_p=0.1, temperature=1.0)  # threshold 0.06
    assert freq[3] == 0 and freq[2] > 0


def test_temperature_sharpens():
    logits = torch.tensor([1.0, 0.0])
    hot = _draws(logits, temperature=2.0)[0]
    cold = _draws(logits, temperature=0.25)[0]
    assert cold > hot
    assert abs(_draws(logits, n=2000, temperature=1.0)[0] - 1 / (1 + math.exp(-1))) < 0.04


def test_seed_reproducible_and_distinct():
    logits = torch.zeros(1, 1000)
    a = [sample(logits.clone(), [_row(seed=7, temperature=1.0)]).token_ids[0] for _ in range(3)]
    assert len(set(a)) == 1
    b = {sample(logits.clone(), [_row(seed=s, temperature=1.0)]).token_ids[0] for s in range(10)}
    assert len(b) > 5


def test_penalties():
    logits = torch.tensor([[2.0, 2.0, -1.0, 0.5]])
    # repetition: positive logits divided, negative multiplied, for prompt and output tokens
    out = logits.clone()
    sample(out, [_row(prompt=(0,), out=(2,), repetition_penalty=2.0, temperature=0.0)])
    assert out[0].tolist() == [1.0, 2.0, -2.0, 0.5]
    # frequency and presence: on generated tokens only, by count
    out = logits.clone()
    sample(out, [_row(prompt=(3,), out=(1, 1, 0), frequency_penalty=0.5, presence_penalty=0.25, temperature=0.0)])
    assert out[0].tolist() == pytest.approx([2.0 - 0.5 - 0.25, 2.0 - 1.0 - 0.25, -1.0, 0.5])


def test_tiny_repetition_penalty_stays_finite():
    """A penalty of 1e-38 sends seen positive logits past float32's range: they are clamped
    (the limit of the penalty), never inf or NaN, so sampling still picks a seen token."""
    logits = torch.tensor([[5.0, 4.0, -1.0, 0.5]])
    for temperature, seed in ((0.0, None), (1.0, 3), (0.5, 4)):
        out = logits.clone()
        res = sample(out, [_row(prompt=(0, 1), repetition_penalty=1e-38, temperature=temperature, seed=seed)])
        assert torch.isfinite(out[:, :2]).all()
        assert res.token_ids[0] in (0, 1)


def test_logprobs_are_raw_distribution():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    ref = torch.log_softmax(logits, -1)[0]
    out = sample(logits.clone(), [_row(temperature=0.0, logprobs=2, repetition_penalty=1.5)])
    lp, top = out.logprobs[0]
    assert lp == pytest.approx(ref[0].item())
    assert [t for t, _ in top] == [0, 1] and top[1][1] == pytest.approx(ref[1].item())


@pytest.mark.parametrize("kw,msg", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.1}, "top_p"),
    ({"n": 0}, "n must"), ({"n": 99}, "99"), ({"max_tokens": 0}, "max_tokens"), ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"logprobs": 50}, "50"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"max_tokens": -1}, "max_tokens must be at least 1"), ({"seed": 1 << 63}, "64-bit"),
    ({"seed": -(1 << 63) - 1}, "64-bit"),
])
def test_params_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_logit_bias_moves_greedy_and_leaves_raw_logprobs():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    top = sample(logits.clone(), [_row(temperature=0.0)]).token_ids[0]
    assert top == 1
    out = sample(logits.clone(), [_row(temperature=0.0, logit_bias={1: -100.0, 2: 3.0}, logprobs=1)])
    assert out.token_ids == [2]
    assert abs(out.logprobs[0][0] - torch.log_softmax(logits[0], -1)[2].item()) < 1e-6


_MIXED = [dict(temperature=0.7), dict(temperature=1.0, top_k=3), dict(temperature=1.3, top_p=0.6),
          dict(temperature=0.9, min_p=0.2), dict(temperature=1.0, top_k=5, top_p=0.8, min_p=0.05),
          dict(temperature=2.0, top_k=40), dict(temperature=0.5, top_p=0.999)]


def test_batched_filter_matches_per_row_filter():
    from kiln.runtime.sampler import _filter, _filter_batch

    torch.manual_seed(0)
    logits = torch.randn(len(_MIXED), 40) * 3
    params = [SamplingParams(**kw) for kw in _MIXED]
    got = _filter_batch(logits.clone(), params)
    for i, p in enumerate(params):
        want = _filter(logits[i].clone(), p)
        assert torch.equal(got[i] > 0, want > 0), f"row {i} ({_MIXED[i]}) keeps other tokens"
        torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-7)


def test_unseeded_rows_are_drawn_together_from_the_filtered_distribution():
    torch.manual_seed(1)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().repeat(n, 1)
    out = sample(logits.clone(), [_row(temperature=1.0, top_k=3) for _ in range(n)])
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / n
    assert freq[3] == 0
    torch.testing.assert_close(freq[:3], probs[:3] / probs[:3].sum(), atol=0.03, rtol=0)


def test_mixed_batch_greedy_seeded_and_free_rows():
    torch.manual_seed(2)
    logits = torch.randn(6, 30)
    rows = [_row(temperature=0.0), _row(seed=7, temperature=0.8, top_p=0.9), _row(temperature=0.8),
            _row(temperature=0.0), _row(seed=9, temperature=1.0, top_k=4), _row(temperature=1.2, min_p=0.1)]
    out = sample(logits.clone(), rows).token_ids
    assert out[0] == logits[0].argmax() and out[3] == logits[3].argmax()
    # a seeded row gives the same token as when it is sampled alone
    assert out[1] == sample(logits[1:2].clone(), [_row(seed=7, temperature=0.8, top_p=0.9)]).token_ids[0]
    assert out[4] == sample(logits[4:5].clone(), [_row(seed=9, temperature=1.0, top_k=4)]).token_ids[0]
    assert all(0 <= t < 30 for t in out)


def test_banned_tokens_are_never_chosen_but_raw_logprobs_keep_them():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0], [0.0, 6.0, 1.0, 0.0]])
    rows = [SamplingRow(SamplingParams(temperature=0.0, logprobs=1), [1], [], None, banned_token_ids=[0]),
            SamplingRow(SamplingParams(temperature=1.0, top_k=2, seed=3), [1], [], torch.Generator().manual_seed(3),
                        banned_token_ids=[1, 99])]  # 99: outside the vocabulary, ignored
    out = sample(logits.clone(), rows)
    assert out.token_ids[0] == 1 and out.token_ids[1] in (0, 2, 3) and out.token_ids[1] != 1
    assert out.logprobs[0][1][0][0] == 0  # the raw top-1 is still the banned token
