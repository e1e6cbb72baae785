"""Tests for trl_sae.generation.capture: in-generation logprob capture and the teacher-forced counterpart."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.generation.capture import (
    RolloutOutput,
    _SampledTokenCapture,
    _StepScoresCapture,
    forward_logprobs,
    generate_with_logprobs,
)

PROMPTS = ["hello", "a", "what is 2+2?", "xy z", "Solve: 3*7", "ok"]
MAX_NEW = 16
# Random tiny models have nearly flat logits; these make the distribution peaky and EOS likely enough
# that, at seed 0, some rows stop early and some run out of budget under every decoding mode tested.
LOGIT_SCALE = 5.0
EOS_BIAS = 2.0


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """One intra-op thread: these are tiny ops, and on a loaded 2-core box OpenMP threads spinning
    against other processes made generation ~50x slower (0.15 s -> 10 s for 48 steps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _shape_logits(model: torch.nn.Module, eos_id: int) -> torch.nn.Module:
    """Rescale logits and raise EOS's, through an lm_head hook so generate and forward see the same model."""
    bias = torch.zeros(model.config.vocab_size)
    bias[eos_id] = EOS_BIAS
    model.lm_head.register_forward_hook(lambda module, args, out: out * LOGIT_SCALE + bias)
    return model.eval()


@pytest.fixture
def eos_model(tokenizer):
    return _shape_logits(build_tiny_qwen3(tokenizer, seed=0), tokenizer.eos_token_id)


@pytest.fixture
def prompts(tokenizer):
    enc = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert tokenizer.padding_side == "left"
    return enc.input_ids, enc.attention_mask


def _config(mode: str, **overrides) -> GenerationConfig:
    if mode == "greedy":
        return GenerationConfig(do_sample=False, max_new_tokens=MAX_NEW, **overrides)
    temperature = float(mode)
    return GenerationConfig(
        do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=MAX_NEW, **overrides
    )


def _temperature(mode: str) -> float:
    return 1.0 if mode == "greedy" else float(mode)


def _reference_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature):
    """Plain full-vocabulary logits at the positions predicting each completion token: (B, T, V)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits
    steps = completion_ids.shape[1]
    return logits[:, -steps - 1 : -1].float() / temperature


@pytest.mark.parametrize("mode", ["1.0", "0.7", "greedy"])
def test_captured_logprobs_match_teacher_forced(eos_model, prompts, tokenizer, mode):
    prompt_ids, prompt_mask = prompts
    torch.manual_seed(0)
    out = generate_with_logprobs(eos_model, prompt_ids, prompt_mask, _config(mode))
    assert isinstance(out, RolloutOutput)
    lengths = out.completion_mask.sum(1)
    # The scenario this test is about: ragged prompts, some rows stop early, some are truncated.
    assert out.is_truncated.any() and (~out.is_truncated).any()
    assert (lengths < MAX_NEW).any()

    with torch.no_grad():
        logprobs, entropies = forward_logprobs(
            eos_model,
            prompt_ids,
            prompt_mask,
            out.completion_ids,
            out.completion_mask,
            temperature=_temperature(mode),
            return_entropy=True,
        )
        ref = _reference_logits(
            eos_model, prompt_ids, prompt_mask, out.completion_ids, out.completion_mask, _temperature(mode)
        )
    torch.testing.assert_close(out.logprobs, logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.entropies, entropies, atol=1e-4, rtol=0)

    # Entropy against a direct full-softmax computation.
    mask = out.completion_mask.bool()
    probs = ref.softmax(-1)
    direct_entropy = -(probs * ref.log_softmax(-1)).sum(-1) * mask
    torch.testing.assert_close(out.entropies, direct_entropy, atol=1e-4, rtol=0)
    direct_logprobs = ref.log_softmax(-1).gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1) * mask
    torch.testing.assert_close(out.logprobs, direct_logprobs, atol=1e-4, rtol=0)
    if mode == "greedy":
        # Greedy picks the argmax: each captured logprob is the row's maximum.
        torch.testing.assert_close(out.logprobs, ref.log_softmax(-1).amax(-1) * mask, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["1.0", "greedy"])
def test_masks_padding_and_truncation(eos_model, prompts, tokenizer, mode):
    prompt_ids, prompt_mask = prompts
    torch.manual_seed(0)
    out = generate_with_logprobs(eos_model, prompt_ids, prompt_mask, _config(mode))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    batch, width = out.completion_ids.shape
    assert batch == len(PROMPTS) and width <= MAX_NEW
    assert out.completion_mask.dtype == torch.long and out.logprobs.dtype == torch.float32
    assert out.entropies.dtype == torch.float32 and out.is_truncated.dtype == torch.bool
    # No all-padding column survives the trim.
    assert out.completion_mask[:, -1].any()
    for row in range(batch):
        ids, mask = out.completion_ids[row], out.completion_mask[row].bool()
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any(), "mask must be a prefix"
        eos_positions = (ids[:length] == eos).nonzero().flatten().tolist()
        if out.is_truncated[row]:
            assert eos_positions == [] and length == MAX_NEW
        else:
            assert eos_positions == [length - 1], "valid part ends at (and includes) the first EOS"
        assert (ids[length:] == pad).all()
        assert (out.logprobs[row, length:] == 0).all() and (out.entropies[row, length:] == 0).all()
        assert (out.logprobs[row, :length] <= 0).all() and (out.entropies[row, :length] >= 0).all()
    torch.testing.assert_close(out.lengths, out.completion_mask.sum(1))


def test_matches_plain_generate(eos_model, prompts):
    """The capture observes generation without changing it: same tokens as `model.generate`."""
    prompt_ids, prompt_mask = prompts
    config = _config("1.0")
    torch.manual_seed(3)
    out = generate_with_logprobs(eos_model, prompt_ids, prompt_mask, config)
    torch.manual_seed(3)
    plain = eos_model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=config)
    completion = plain[:, prompt_ids.shape[1] :]
    width = out.completion_ids.shape[1]
    torch.testing.assert_close(
        out.completion_ids, completion[:, :width].masked_fill(out.completion_mask == 0, 0)
    )


def test_eos_list_including_pad_token(eos_model, prompts, tokenizer):
    """Qwen3 lists <|endoftext|> (also its pad token) as an EOS: the mask must follow EOS, not `!= pad`."""
    prompt_ids, prompt_mask = prompts
    eos_ids = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    torch.manual_seed(0)
    out = generate_with_logprobs(
        eos_model,
        prompt_ids,
        prompt_mask,
        _config("1.0", eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id),
    )
    for row in range(out.completion_ids.shape[0]):
        length = int(out.lengths[row])
        is_eos = torch.isin(out.completion_ids[row, :length], torch.tensor(eos_ids))
        if out.is_truncated[row]:
            assert not is_eos.any()
        else:
            assert is_eos.nonzero().flatten().tolist() == [length - 1]


def test_generation_config_not_mutated(eos_model, prompts):
    prompt_ids, prompt_mask = prompts
    config = _config("0.7")
    config.output_scores = True  # would store every step; must be overridden on a copy only
    config.return_dict_in_generate = True
    before = copy.deepcopy(config).to_dict()
    model_before = eos_model.generation_config.to_dict()
    generate_with_logprobs(eos_model, prompt_ids, prompt_mask, config)
    assert config.to_dict() == before
    assert eos_model.generation_config.to_dict() == model_before


def test_default_generation_config_and_beam_search_rejected(eos_model, prompts):
    prompt_ids, prompt_mask = prompts
    eos_model.generation_config.max_new_tokens = 4
    out = generate_with_logprobs(eos_model, prompt_ids, prompt_mask)
    assert out.completion_ids.shape[1] <= 4
    with pytest.raises(ValueError, match="sampling and greedy"):
        generate_with_logprobs(eos_model, prompt_ids, prompt_mask, _config("greedy", num_beams=2))


def test_peft_lora_model(tokenizer, prompts):
    from peft import LoraConfig, get_peft_model

    base = _shape_logits(build_tiny_qwen3(tokenizer, seed=0), tokenizer.eos_token_id)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, lora).eval()
    prompt_ids, prompt_mask = prompts
    torch.manual_seed(0)
    out = generate_with_logprobs(model, prompt_ids, prompt_mask, _config("0.7"))
    with torch.no_grad():
        logprobs, _ = forward_logprobs(
            model, prompt_ids, prompt_mask, out.completion_ids, out.completion_mask, temperature=0.7
        )
    torch.testing.assert_close(out.logprobs, logprobs, atol=1e-4, rtol=0)
    # The adapter is really in the computation: disabling it changes the logprobs.
    with torch.no_grad(), model.disable_adapter():
        base_logprobs, _ = forward_logprobs(
            model, prompt_ids, prompt_mask, out.completion_ids, out.completion_mask, temperature=0.7
        )
    assert not torch.allclose(base_logprobs, logprobs, atol=1e-3)

    # Gradients reach the LoRA weights through forward_logprobs.
    model.train()
    logprobs, _ = forward_logprobs(
        model, prompt_ids, prompt_mask, out.completion_ids, out.completion_mask, temperature=0.7
    )
    logprobs.sum().backward()
    lora_grads = [p.grad for n, p in model.named_parameters() if "lora_" in n]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)


def test_forward_logprobs_gradients_match_full_log_softmax(eos_model, prompts):
    """Chunked + checkpointed computation gives the same values and gradients as a full log-softmax."""
    prompt_ids, prompt_mask = prompts
    torch.manual_seed(0)
    out = generate_with_logprobs(eos_model, prompt_ids, prompt_mask, _config("0.7"))
    weights = torch.randn(out.completion_ids.shape)

    eos_model.zero_grad()
    logprobs, entropies = forward_logprobs(
        eos_model,
        prompt_ids,
        prompt_mask,
        out.completion_ids,
        out.completion_mask,
        temperature=0.7,
        return_entropy=True,
        chunk_size=3,  # several chunks per row
    )
    assert logprobs.requires_grad and entropies.requires_grad
    ((logprobs * weights).sum() + entropies.sum()).backward()
    grads = {n: p.grad.clone() for n, p in eos_model.named_parameters() if p.grad is not None}
    assert grads

    eos_model.zero_grad()
    ref = _reference_logits(eos_model, prompt_ids, prompt_mask, out.completion_ids, out.completion_mask, 0.7)
    mask = out.completion_mask.bool()
    logp_full = ref.log_softmax(-1)
    ref_logprobs = logp_full.gather(-1, out.completion_ids.unsqueeze(-1)).squeeze(-1) * mask
    ref_entropies = -(logp_full.exp() * logp_full).sum(-1) * mask
    ((ref_logprobs * weights).sum() + ref_entropies.sum()).backward()
    torch.testing.assert_close(logprobs, ref_logprobs, atol=1e-5, rtol=0)
    for name, param in eos_model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[name], param.grad, atol=1e-4, rtol=1e-3)


def test_forward_logprobs_masked_positions_and_no_entropy(eos_model, prompts):
    prompt_ids, prompt_mask = prompts
    completion_ids = torch.randint(3, 50, (len(PROMPTS), 5))
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[0, 2:] = 0
    completion_mask[1, :] = 0
    with torch.no_grad():
        logprobs, entropies = forward_logprobs(
            eos_model, prompt_ids, prompt_mask, completion_ids, completion_mask
        )
    assert entropies is None
    assert logprobs.shape == (len(PROMPTS), 5)
    assert (logprobs[0, 2:] == 0).all() and (logprobs[1] == 0).all()
    assert (logprobs[2:] < 0).all()
    # Tokens after the mask never influence earlier ones (causal) nor the result.
    changed = completion_ids.clone()
    changed[0, 2:] = 7
    with torch.no_grad():
        again, _ = forward_logprobs(eos_model, prompt_ids, prompt_mask, changed, completion_mask)
    torch.testing.assert_close(again, logprobs)


def test_capture_holds_one_step_only():
    """Unit check of the two hooks: after each token the (B, V) step tensor is released, and results
    land in preallocated (B, capacity) buffers (growing past the announced capacity if needed)."""
    scores_capture = _StepScoresCapture(capacity=3)
    token_capture = _SampledTokenCapture(scores_capture)
    batch, vocab, steps = 3, 11, 5
    input_ids = torch.zeros(batch, 4, dtype=torch.long)
    expected_logprobs, expected_entropies = [], []
    for _ in range(steps):
        scores = torch.randn(batch, vocab)
        scores[0, :5] = -float("inf")  # a top-k style truncation must keep the entropy finite
        assert scores_capture(input_ids, scores) is scores
        assert scores_capture.step_logprobs.shape == (batch, vocab)
        token = scores.argmax(-1)
        input_ids = torch.cat([input_ids, token[:, None]], dim=1)
        stop = token_capture(input_ids, None)
        assert stop.dtype == torch.bool and not stop.any()
        assert scores_capture.step_logprobs is None
        logp = scores.log_softmax(-1)
        expected_logprobs.append(logp.gather(-1, token[:, None]).squeeze(-1))
        probs = logp.exp()
        expected_entropies.append(-(probs * logp.masked_fill(probs == 0, 0)).sum(-1))
    logprobs, entropies = scores_capture.captured()
    assert logprobs.shape == entropies.shape == (batch, steps)
    torch.testing.assert_close(logprobs, torch.stack(expected_logprobs, 1))
    torch.testing.assert_close(entropies, torch.stack(expected_entropies, 1))
    assert torch.isfinite(entropies).all()
    # Only (B, capacity) buffers are kept, never a (B, V) tensor per step.
    held = [v for v in vars(scores_capture).values() if isinstance(v, torch.Tensor)]
    assert all(t.shape[0] == batch and t.shape[1] != vocab for t in held)


class _PeakLiveTensorBytes(TorchDispatchMode):
    """Peak bytes of CPU tensor storages allocated inside the mode and still alive (a CPU 'max_allocated').

    Every op's fresh (non-aliasing) output storage is counted from its creation until the last tensor
    seen to use it is garbage collected. Views and in-place results of tracked storages extend their
    lifetime; storages created before the mode (weights) are never counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, live tensor objects]
        self.current = 0
        self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.storages[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.storages[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        fresh = not any(ret.alias_info is not None for ret in func._schema.returns)
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr == 0:
                continue
            entry = self.storages.get(ptr)
            if entry is None:
                if not fresh:
                    continue
                entry = self.storages[ptr] = [storage.nbytes(), 0]
                self.current += entry[0]
                self.peak = max(self.peak, self.current)
            entry[1] += 1
            weakref.finalize(tensor, self._release, ptr)
        return out


def _wide_vocab_model(vocab: int) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return Qwen3ForCausalLM(config).eval()


def test_capture_peak_memory_is_one_step_not_all_scores():
    """Measured peak live tensor bytes: capture is O(B x V); `output_scores=True` + stack is O(T x B x V)."""
    vocab, batch, steps = 8192, 4, 48
    model = _wide_vocab_model(vocab)
    prompt_ids = torch.randint(2, vocab, (batch, 6))
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[0, :3] = 0
    config = GenerationConfig(
        do_sample=True,
        top_k=0,
        top_p=1.0,
        max_new_tokens=steps,
        min_new_tokens=steps,
        pad_token_id=0,
        eos_token_id=1,
    )
    step_bytes = batch * vocab * 4

    with _PeakLiveTensorBytes() as capture_mem:
        out = generate_with_logprobs(model, prompt_ids, prompt_mask, config)
    assert out.logprobs.shape == (batch, steps)

    with _PeakLiveTensorBytes() as stored_mem, torch.no_grad():
        result = model.generate(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            generation_config=config,
            output_scores=True,
            return_dict_in_generate=True,
        )
        logits = torch.stack(result.scores, dim=1)
        completion = result.sequences[:, prompt_ids.shape[1] :]
        logprobs = logits.log_softmax(-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        del logits, result
    assert logprobs.shape == (batch, steps)

    # A handful of (B, V) step temporaries (logits, float copy, log-softmax, probabilities)...
    assert capture_mem.peak < 12 * step_bytes, capture_mem.peak / step_bytes
    # ...against every step's scores, held at least twice while stacking.
    assert stored_mem.peak > 2 * steps * step_bytes
    assert stored_mem.peak > 10 * capture_mem.peak


def test_forward_logprobs_peak_memory_is_chunked():
    """No float32 (B, T, V) log-softmax: beyond the model's own logits, only chunk-sized temporaries."""
    vocab, batch, steps = 8192, 4, 64
    model = _wide_vocab_model(vocab)
    prompt_ids = torch.randint(2, vocab, (batch, 6))
    prompt_mask = torch.ones_like(prompt_ids)
    completion_ids = torch.randint(2, vocab, (batch, steps))
    completion_mask = torch.ones_like(completion_ids)
    logits_bytes = batch * (steps + 1) * vocab * 4  # what the model itself returns (logits_to_keep=T+1)

    with _PeakLiveTensorBytes() as chunked, torch.no_grad():
        forward_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7, True, chunk_size=16
        )
    with _PeakLiveTensorBytes() as naive, torch.no_grad():
        ref = _reference_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7)
        ref.log_softmax(-1).gather(-1, completion_ids.unsqueeze(-1))
        del ref
    assert chunked.peak < logits_bytes * 1.25, chunked.peak / logits_bytes
    assert naive.peak > logits_bytes * 1.9, naive.peak / logits_bytes


def test_reward_model_scores_the_sampled_sequence_when_a_prompt_token_is_the_pad_id(tokenizer):
    """pad = EOS = the chat template's end of message (SmolLM2): a prompt carries the pad id as a real token.
    The reward model must score the sampled sequence, as a direct forward of it does."""
    from types import SimpleNamespace

    from transformers import AutoModelForSequenceClassification

    from trl_sae.demo.tiny import build_tiny_qwen3_critic
    from trl_sae.trainer.parts.rollout import Rollouts
    from trl_sae.trainer.rollout_batch import RolloutBatch

    torch.manual_seed(3)
    config = build_tiny_qwen3_critic(tokenizer).config
    reward_model = AutoModelForSequenceClassification.from_config(config).eval()
    pad = tokenizer.pad_token_id
    assert config.pad_token_id == pad
    prompts = [[11, pad, 12, 13], [14, 15]]  # row 0: a message end written as the pad id, mid-prompt
    completions = [[16, 17, 18], [19, 20, 21, 22, 23]]
    prompt_ids = torch.tensor([[pad] * (4 - len(p)) + p for p in prompts])  # left-padded
    prompt_mask = torch.tensor([[1] * 4, [0, 0, 1, 1]])
    completion_ids = torch.tensor([c + [pad] * (5 - len(c)) for c in completions])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (5 - len(c)) for c in completions])
    batch = RolloutBatch(
        prompts=["", ""], columns={}, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        completion_ids=completion_ids, completion_mask=completion_mask, logprobs=torch.zeros(2, 5),
        entropies=torch.zeros(2, 5), is_truncated=torch.zeros(2, dtype=torch.bool),
    )  # fmt: skip
    rollouts = SimpleNamespace(reward_model=reward_model, processing_class=tokenizer)
    with torch.no_grad():
        scores = Rollouts._reward_model_scores(rollouts, batch)
        direct = torch.stack(
            [reward_model(input_ids=torch.tensor([p + c])).logits[0, 0] for p, c in zip(prompts, completions)]
        )
    torch.testing.assert_close(scores, direct, rtol=1e-5, atol=1e-6)
    assert torch.equal(batch.reward_per_function["reward_model"], scores)
