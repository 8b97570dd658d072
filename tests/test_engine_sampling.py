"""Seeded sampling: purity of the noise, greedy/top-k semantics, log-probs, parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from areal_async.embedded.request import decode_sampling
from areal_async.embedded.engine.noise_hash import gumbel_noise, noise_key, noise_uniform
from areal_async.embedded.engine.sampling import sample


def _params(b: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1):
    return torch.full((b,), temperature), torch.full((b,), top_p), torch.full((b,), top_k, dtype=torch.int64)


def test_noise_row_depends_only_on_its_seed_and_position():
    alone = gumbel_noise([7], [12], 50)
    batched = gumbel_noise([3, 7, 7], [12, 12, 13], 50)
    assert torch.equal(batched[1], alone[0])
    assert not torch.equal(batched[0], alone[0])  # other seed
    assert not torch.equal(batched[2], alone[0])  # other position


def test_noise_equals_the_integer_reference():
    # the tensor hash (int64 with wrapping multiplies) against exact Python integers, including
    # seeds above 2**63 and keys whose products overflow
    seeds, positions = [0, 7, 2**64 - 1, 12345678901234567890], [0, 12, 3, 100000]
    noise = gumbel_noise(seeds, positions, 300)
    for b, (seed, position) in enumerate(zip(seeds, positions)):
        key = noise_key(seed, position)
        for i in (0, 1, 2, 150, 299):
            u = noise_uniform(key, i)
            assert 0.0 < u < 1.0
            expected = -math.log(-math.log(u))
            assert abs(noise[b, i].item() - expected) < 1e-5 * max(1.0, abs(expected)), (b, i)


def test_greedy_picks_argmax_and_reports_untempered_logprob():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, -1.0]])
    t, p, k = _params(2, temperature=0.0)
    tokens, logprobs = sample(logits, t, p, k, [1, 2], [5, 5])
    assert tokens.tolist() == [1, 0]
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 0]]
    assert torch.allclose(logprobs, expected)


def test_logprob_is_of_the_tempered_full_vocabulary_distribution():
    torch.manual_seed(0)
    logits = torch.randn(4, 30)
    t, p, k = _params(4, temperature=0.7, top_k=5)
    tokens, logprobs = sample(logits, t, p, k, [1, 2, 3, 4], [0, 0, 0, 0])
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, expected, atol=1e-6)
    top5 = logits.topk(5, dim=-1).indices
    assert all(tok in row for tok, row in zip(tokens.tolist(), top5.tolist()))


def test_top_p_keeps_the_smallest_nucleus():
    # probs [0.5, 0.3, 0.2]: top_p 0.6 keeps {0, 1} (mass before token 1 is 0.5 < 0.6, before 2 is 0.8)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).repeat(200, 1)
    t, p, k = _params(200, top_p=0.6)
    tokens, _ = sample(logits, t, p, k, list(range(200)), [0] * 200)
    assert set(tokens.tolist()) == {0, 1}


def test_sampling_frequencies_follow_softmax():
    # 4000 independent draws (distinct seeds) from softmax([0, 1, 2]) = [0.090, 0.245, 0.665]
    n = 4000
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(n, 1)
    t, p, k = _params(n)
    tokens, _ = sample(logits, t, p, k, list(range(n)), [3] * n)
    freq = torch.bincount(tokens, minlength=3).double() / n
    target = torch.softmax(torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), -1)
    sigma = torch.sqrt(target * (1 - target) / n)
    assert torch.all((freq - target).abs() < 4 * sigma), (freq, target)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"max_new_tokens": -1}, "max_new_tokens -1 is negative"),
        ({"max_new_tokens": "16"}, "max_new_tokens '16' has the wrong JSON type"),
        ({"ignore_eos": "false"}, "ignore_eos 'false' has the wrong JSON type"),
        ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens 5 is not in \\[0, max_new_tokens \\(4\\)\\]"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "finite"),
        ({"temperature": float("inf")}, "finite"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"bogus": 1}, "unknown sampling_params field 'bogus'"),
        ({"min_p": 0.1}, "min_p"),
        ({"stop": [""]}, "empty string"),
        ({"stop": ["a"] * 33}, "at most 32"),
        ({"stop_regex": ["a+"]}, "stop_regex"),
        ({"n": 2}, "sampling_params.n=2 is not supported"),
        ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ],
)
def test_bad_sampling_params_are_rejected(raw, message):
    with pytest.raises(ValueError, match=message):
        decode_sampling(raw)


def test_sglang_defaults_and_neutral_fields_are_accepted():
    params = decode_sampling({"top_k": None, "min_p": 0.0, "skip_special_tokens": False, "stop": []})
    assert params.max_new_tokens == 128 and params.top_k == -1 and not params.skip_special_tokens
    assert math.isclose(params.temperature, 1.0)


def test_mixed_rows_sample_as_they_would_alone():
    # greedy, plain, top-k and top-p rows in one call: each row's token and log-prob equal its
    # own single-row call (which rows share the call changes nothing)
    torch.manual_seed(3)
    logits = torch.randn(4, 40)
    temperature = torch.tensor([0.0, 1.0, 0.8, 1.2])
    top_p, top_k = torch.tensor([1.0, 1.0, 1.0, 0.5]), torch.tensor([-1, -1, 3, -1])
    seeds, positions = [11, 12, 13, 14], [5, 6, 7, 8]
    tokens, logprobs = sample(logits, temperature, top_p, top_k, seeds, positions)
    for b in range(4):
        alone = sample(logits[b : b + 1], temperature[b : b + 1], top_p[b : b + 1], top_k[b : b + 1],
                       seeds[b : b + 1], positions[b : b + 1])
        assert alone[0].item() == tokens[b].item() and alone[1].item() == logprobs[b].item(), b
    assert tokens[0].item() == int(logits[0].argmax())
    assert tokens[2].item() in logits[2].topk(3).indices.tolist()


def test_temperature_below_epsilon_samples_greedily():
    # logits / 1e-40 overflows to inf/NaN; such temperatures are greedy, as on SGLang
    assert decode_sampling({"temperature": 1e-40}).temperature == 0.0
    assert decode_sampling({"temperature": 0.5}).temperature == 0.5


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_banned_tokens_are_never_drawn_and_log_probs_stay_unmasked(device):
    # rows: greedy, plain (the fused CUDA path when nothing is banned), top-k; each bans its own
    # favourite tokens. The draw is that of the masked logits (same seed: masking shifts
    # log_softmax by a per-row constant, so the Gumbel argmax is the same); the log-prob is the
    # unmasked log_softmax(logits / T) of the drawn token
    torch.manual_seed(5)
    logits = torch.randn(3, 50, device=device) * 3
    temperature, top_p, top_k = torch.tensor([0.0, 1.0, 0.9]), torch.tensor([1.0, 1.0, 1.0]), torch.tensor([-1, -1, 4])
    seeds, positions = [1, 2, 3], [10, 11, 12]
    bans = [(b, logits[b].topk(3).indices.tolist()) for b in range(3)]
    tokens, logprobs = sample(logits, temperature, top_p, top_k, seeds, positions, bans=bans)
    masked = logits.clone()
    for b, ids in bans:
        masked[b, ids] = float("-inf")
        assert tokens[b].item() not in ids
    expected, _ = sample(masked, temperature, top_p, top_k, seeds, positions)
    assert tokens.tolist() == expected.tolist()
    z = logits / torch.tensor([1.0, 1.0, 0.9], device=device)[:, None]
    unmasked = torch.log_softmax(z, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.allclose(logprobs, unmasked, atol=1e-6, rtol=0)
