"""The log-prob head's chunk (issue 23): a setting, chosen from the vocabulary by default, and a small working set.

Results (log-probs, entropies, gradients) must not depend on the chunk size; the default keeps one chunk's
``(chunk, V)`` temporaries near 64 MiB; one chunk holds at most three ``(chunk, V)`` float32 tensors at a
time, forward and backward; ``SAEPPOConfig.logprob_chunk_size`` is validated and reaches every pass.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trl_sae import SAEPPOConfig
from trl_sae.generation import capture
from trl_sae.generation.capture import (
    LOGPROB_CHUNK_BUDGET_BYTES,
    LOGPROB_CHUNK_BYTES_PER_ELEMENT,
    _chunk_logprobs,
    default_logprob_chunk_size,
    logprobs_from_logits,
    sequence_logprobs,
)

from .test_chunked_logprobs import TEMPERATURE, ragged_batch, untied_qwen3, values_and_grads
from .test_rollout import _PeakLiveTensorBytes
from .test_trainer import make_trainer

STEPS = 7  # ragged_batch's completion width; 12 valid tokens in all


@pytest.fixture(scope="module")
def model_and_reference(tokenizer):
    """The untied tiny Qwen3 and the full-logits reference: values, entropies and gradients, in float64."""
    model = untied_qwen3(tokenizer)
    inputs = ragged_batch(model.config.vocab_size)
    weights = [model.lm_head.weight, model.model.layers[1].mlp.up_proj.weight]

    def full_logits(m, x):
        logits = m(**x, use_cache=False).logits[:, -(STEPS + 1) : -1].double() / TEMPERATURE
        logp = torch.log_softmax(logits, dim=-1)
        tokens, mask = x["input_ids"][:, -STEPS:], x["attention_mask"][:, -STEPS:]
        token_logp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) * mask
        entropy = -(logp.exp() * logp).sum(-1) * mask
        return token_logp, entropy

    reference = values_and_grads(full_logits, model, inputs, weights)
    return model, inputs, weights, reference


@settings(max_examples=12, deadline=None)
@given(chunk_size=st.one_of(st.none(), st.integers(min_value=1, max_value=40)))
def test_results_equal_the_full_logits_for_every_chunk_size(model_and_reference, chunk_size):
    """1 position per chunk, chunks across rows, one chunk for all 12 tokens, > T, and the default (None)."""
    model, inputs, weights, (ref_lp, ref_ent, ref_grads) = model_and_reference

    def chunked(m, x):
        return sequence_logprobs(
            m, **x, num_completion_tokens=STEPS, temperature=TEMPERATURE, return_entropy=True,
            chunk_size=chunk_size,
        )  # fmt: skip

    lp, ent, grads = values_and_grads(chunked, model, inputs, weights)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    for grad, ref in zip(grads, ref_grads):
        assert ref.abs().sum() > 0
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 6),
    vocab=st.integers(2, 50),
    temperature=st.floats(0.3, 2.0),
    with_entropy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunk_gradient_is_the_exact_one(rows, vocab, temperature, with_entropy, seed):
    """The hand-written backward equals autograd through float64 log_softmax, for log-prob and entropy."""
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=generator)).requires_grad_()
    tokens = torch.randint(0, vocab, (rows,), generator=generator)
    grad_lp, grad_ent = torch.randn(rows, generator=generator), torch.randn(rows, generator=generator)
    lp, ent = _chunk_logprobs(logits, tokens, temperature, with_entropy)
    loss = (lp * grad_lp).sum() + ((ent * grad_ent).sum() if with_entropy else 0)
    loss.backward()

    ref_logits = logits.detach().double().requires_grad_()
    logp = torch.log_softmax(ref_logits / temperature, dim=-1)
    ref_lp = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(logp.exp() * logp).sum(-1)
    ref_loss = (ref_lp * grad_lp.double()).sum() + (
        (ref_ent * grad_ent.double()).sum() if with_entropy else 0
    )
    ref_loss.backward()
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    if with_entropy:
        torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    else:
        assert ent.numel() == 0
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-4, atol=1e-5)


def test_bf16_logits_get_a_bf16_gradient_from_float32_math():
    logits = torch.randn(4, 33).bfloat16().requires_grad_()
    tokens = torch.tensor([0, 5, 32, 7])
    lp, ent = _chunk_logprobs(logits, tokens, 0.7, True)
    assert lp.dtype == ent.dtype == torch.float32
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    ref = logits.detach().float().requires_grad_()
    ref_lp, ref_ent = _chunk_logprobs(ref, tokens, 0.7, True)
    (ref_lp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(logits.grad, ref.grad.bfloat16())


def test_chunk_math_stays_float32_under_autocast():
    """Autocast (bf16) around the log-prob pass must not run the entropy's product in bf16."""
    logits = (4 * torch.randn(6, 1000)).bfloat16()
    tokens = torch.randint(0, 1000, (6,))
    plain_lp, plain_ent = _chunk_logprobs(logits, tokens, 1.0, True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        lp, ent = _chunk_logprobs(logits, tokens, 1.0, True)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, plain_lp, rtol=0, atol=0)
    torch.testing.assert_close(ent, plain_ent, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("vocab", "expected"),
    [(151_936, 32), (32_000, 168), (262_144, 16), (4096, 1360), (10**9, 1), (1, 5592400)],
)
def test_default_chunk_size_from_the_vocabulary(vocab, expected):
    assert default_logprob_chunk_size(vocab) == expected


@settings(max_examples=50, deadline=None)
@given(vocab=st.integers(1, 10**7), budget=st.integers(2**16, 2**30))
def test_default_chunk_fits_the_budget_and_uses_it(vocab, budget):
    chunk = default_logprob_chunk_size(vocab, budget)
    per_position = LOGPROB_CHUNK_BYTES_PER_ELEMENT * vocab
    assert chunk >= 1
    if per_position <= budget:
        assert chunk * per_position <= budget  # within the budget ...
        assert (chunk + 8) * per_position > budget  # ... and no whole tile of 8 positions more fits
        assert chunk < 8 or chunk % 8 == 0
    else:
        assert chunk == 1  # a single position over the budget: one at a time, never zero


def test_default_budget_is_64_mib():
    assert LOGPROB_CHUNK_BUDGET_BYTES == 64 * 2**20


def test_one_chunk_holds_at_most_three_float32_chunk_tensors():
    """Peak live bytes of a chunk's checkpointed forward + backward over the logits path's needs.

    A (chunk, V) float32 tensor is the unit: the logits, the log-softmax and one temporary at a time (the
    exp for the entropy; the probabilities while the gradient is built). Autograd's own log_softmax,
    softmax and product for the entropy kept five or more.
    """
    vocab, chunk, hidden = 8192, 16, 8
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states = torch.randn(3 * chunk, hidden, requires_grad=True)
    tokens = torch.randint(0, vocab, (3 * chunk,))
    mask = torch.ones(1, 3 * chunk, dtype=torch.long)
    unit = chunk * vocab * 4
    with _PeakLiveTensorBytes() as live:
        lp, ent = capture.logprobs_from_hidden_states(
            states.unsqueeze(0), head, tokens.unsqueeze(0), mask, 0.7, return_entropy=True, chunk_size=chunk
        )
        (lp.sum() + 0.1 * ent.sum()).backward()
    weight_grad = head.weight.numel() * 4  # the head's gradient
    assert live.peak <= 3 * unit + weight_grad + 2**16, (live.peak - weight_grad) / unit


def test_logits_path_honours_the_chunk_and_its_default():
    logits = torch.randn(2, 5, 11)
    tokens = torch.randint(0, 11, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    by_one, _ = logprobs_from_logits(logits, tokens, mask, 1.3, chunk_size=1)
    default, _ = logprobs_from_logits(logits, tokens, mask, 1.3)
    torch.testing.assert_close(by_one, default)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer or None"):
        logprobs_from_logits(logits, tokens, mask, 1.3, chunk_size=0)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True, "32"])
def test_config_rejects_a_bad_chunk_size(tmp_path, bad):
    with pytest.raises(
        ValueError, match=r"^SAEPPOConfig\.logprob_chunk_size: must be a positive number"
    ) as error:
        SAEPPOConfig(output_dir=str(tmp_path), logprob_chunk_size=bad, use_cpu=True, report_to="none")
    assert "\n" not in str(error.value)


def test_trainer_uses_the_configured_chunk_in_every_pass(tmp_path, tokenizer, monkeypatch):
    """The update (policy_logprobs) and the teacher-forced passes (reference log-probs) chunk by the setting."""
    calls: list[tuple[int, bool]] = []
    original = capture._head_chunk_logprobs

    def spy(states, tokens, head, temperature, with_entropy):
        calls.append((states.shape[0], torch.is_grad_enabled()))
        return original(states, tokens, head, temperature, with_entropy)

    monkeypatch.setattr(capture, "_head_chunk_logprobs", spy)
    trainer = make_trainer(
        tmp_path, tokenizer, max_steps=1, response_length=8, logprob_chunk_size=3, kl_coef=0.05
    )
    assert trainer.args.logprob_chunk_size == 3
    trainer.train()
    with_grad = [size for size, grad in calls if grad]
    without_grad = [size for size, grad in calls if not grad]
    assert with_grad and without_grad  # the update and the reference pass
    assert max(size for size, _ in calls) == 3
