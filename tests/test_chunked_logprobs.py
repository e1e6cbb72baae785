"""Log-probabilities from hidden states, the output head applied chunk by chunk (issue 12, part 1).

Every case is checked against the logits path (the model's own ``(B, T, V)`` logits reduced by
``logprobs_from_logits``): values, entropies and gradients w.r.t. trainable weights, to float32 rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3ForCausalLM

from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.generation.capture import logprobs_from_logits, output_head_split, sequence_logprobs
from trl_sae.generation.inputs import sequence_inputs

from .test_peft import make_peft_trainer

TEMPERATURE = 0.7


def untied_qwen3(tokenizer) -> Qwen3ForCausalLM:
    """The tiny Qwen3 with its own lm_head (the default tiny model ties it to the embedding)."""
    config = copy.deepcopy(build_tiny_qwen3(tokenizer, seed=0).config)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def ragged_batch(vocab: int) -> dict[str, torch.Tensor]:
    """Three rows: left-padded prompts, right-padded completions of lengths 7, 3 and 5 (one with a hole)."""
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, vocab, (3, 4), generator=generator)
    prompt_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])
    completion_ids = torch.randint(3, vocab, (3, 7), generator=generator)
    completion_mask = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0], [1, 1, 0, 1, 1, 0, 0]])
    return sequence_inputs(prompt_ids, prompt_mask, completion_ids, completion_mask)


def logits_path(model, inputs, steps):
    """Today's path: the model's (B, T, V) logits, reduced in checkpointed chunks."""
    logits = model(**inputs, use_cache=False).logits[:, -(steps + 1) : -1]
    tokens, mask = inputs["input_ids"][:, -steps:], inputs["attention_mask"][:, -steps:]
    return logprobs_from_logits(logits, tokens, mask, TEMPERATURE, return_entropy=True)


def values_and_grads(compute, model, inputs, weights):
    """(logprobs, entropies) and the gradients of a loss mixing both w.r.t. ``weights``."""
    model.zero_grad(set_to_none=True)
    logprobs, entropies = compute(model, inputs)
    weight = torch.linspace(0.5, 1.5, logprobs.numel()).view_as(logprobs)  # every position counts differently
    ((logprobs * weight).sum() + 0.3 * entropies.sum()).backward()
    return logprobs.detach(), entropies.detach(), [w.grad.clone() for w in weights]


def assert_same_as_logits_path(model, weights, chunk_size=4):
    inputs = ragged_batch(model.config.vocab_size)

    def chunked(m, x):
        return sequence_logprobs(m, **x, num_completion_tokens=7, temperature=TEMPERATURE, return_entropy=True,
                                 chunk_size=chunk_size)  # fmt: skip

    assert not isinstance(output_head_split(model), str)
    lp, ent, grads = values_and_grads(chunked, model, inputs, weights)
    ref_lp, ref_ent, ref_grads = values_and_grads(lambda m, x: logits_path(m, x, 7), model, inputs, weights)
    mask = inputs["attention_mask"][:, -7:].bool()
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
    assert (lp[mask] < 0).all() and (ent[mask] > 0).all()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    for grad, ref in zip(grads, ref_grads):
        assert ref.abs().sum() > 0
        torch.testing.assert_close(grad, ref)
    return lp, ent, grads


def test_plain_untied_model_matches_the_logits_path(tokenizer):
    model = untied_qwen3(tokenizer)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    weights = [model.lm_head.weight, model.model.layers[0].self_attn.q_proj.weight]
    assert_same_as_logits_path(model, weights)


def test_tied_model_matches_the_logits_path(tokenizer):
    model = build_tiny_qwen3(tokenizer, seed=0)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_same_as_logits_path(model, [model.model.embed_tokens.weight])


@pytest.mark.parametrize("tied", [False, True])
def test_lora_with_an_adapted_head_matches_the_logits_path(tokenizer, tied):
    base = build_tiny_qwen3(tokenizer, seed=0) if tied else untied_qwen3(tokenizer)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False
    )
    model = get_peft_model(base, config)
    head = model.get_base_model().lm_head
    assert hasattr(head, "lora_A")  # the head is a LoRA layer: calling it must apply the adapter
    with torch.no_grad():  # the adapter changes the head's logits
        head.lora_B["default"].weight.normal_(0, 0.5)
    weights = [
        head.lora_B["default"].weight,
        model.get_base_model().model.layers[1].self_attn.q_proj.lora_A["default"].weight,
    ]
    lp, _, _ = assert_same_as_logits_path(model, weights)
    with model.disable_adapter(), torch.no_grad():  # disabled adapters: the base head again, both paths
        base_lp, _ = sequence_logprobs(model, **ragged_batch(base.config.vocab_size), num_completion_tokens=7,
                                       temperature=TEMPERATURE)  # fmt: skip
    assert (base_lp - lp).abs().max() > 1e-3


def test_qlora_matches_the_logits_path(tmp_path, tokenizer):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(tmp_path / "tiny")
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", quantization_config=quantization)
    assert base.is_loaded_in_4bit
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    assert_same_as_logits_path(model, [q_proj.lora_A["default"].weight])


def test_results_do_not_depend_on_the_chunk_size(tokenizer):
    model = untied_qwen3(tokenizer)
    weights = [model.lm_head.weight, model.model.layers[1].mlp.up_proj.weight]
    reference = assert_same_as_logits_path(model, weights, chunk_size=256)
    for chunk_size in (1, 3, 14):  # 14 valid tokens: 14 chunks, chunks across rows, one chunk
        lp, ent, grads = assert_same_as_logits_path(model, weights, chunk_size=chunk_size)
        torch.testing.assert_close(lp, reference[0])
        torch.testing.assert_close(ent, reference[1])
        for grad, ref in zip(grads, reference[2]):
            torch.testing.assert_close(grad, ref)


def count_head_calls(module: torch.nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    """Positions per call of ``module`` (its input's size without the hidden dimension)."""
    calls: list[int] = []
    handle = module.register_forward_hook(
        lambda m, args, out: calls.append(args[0].numel() // args[0].shape[-1])
    )
    return calls, handle


def test_head_sees_only_valid_positions_in_chunks(tokenizer):
    model = untied_qwen3(tokenizer)
    calls, handle = count_head_calls(model.lm_head)
    inputs = ragged_batch(model.config.vocab_size)
    logprobs, _ = sequence_logprobs(model, **inputs, num_completion_tokens=7, chunk_size=4)
    logprobs.sum().backward()  # the checkpointed backward recomputes every chunk once
    handle.remove()
    # 7 + 3 + 4 = 14 valid tokens -> chunks of 4, 4, 4, 2 forward, each recomputed once in backward
    assert calls[:4] == [4, 4, 4, 2] and sorted(calls[4:]) == [2, 4, 4, 4]


def test_shared_critic_pass_computes_no_logits(tmp_path, tokenizer):
    trainer = make_peft_trainer(tmp_path, tokenizer)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    head = wrapper.policy.get_base_model().lm_head
    inputs = ragged_batch(wrapper.config.vocab_size)
    calls, handle = count_head_calls(head)
    try:
        policy, values = wrapper(**inputs, num_completion_tokens=7, with_policy=False)
        assert policy is None and values.shape == (3, 7)
        values.sum().backward()
        assert calls == []  # the critic's forward and backward never touch the output head
        with torch.no_grad():
            (logprobs, entropies), values = wrapper(
                **inputs, num_completion_tokens=7, temperature=TEMPERATURE
            )
        assert calls == [14]  # the policy pass: the head on the 14 valid positions only, not (3, 8)
    finally:
        handle.remove()
    with torch.no_grad():
        ref_lp, ref_ent = logits_path(wrapper.policy, inputs, 7)
    torch.testing.assert_close(logprobs, ref_lp)
    torch.testing.assert_close(entropies, ref_ent)


def test_models_that_transform_their_logits_keep_the_logits_path(tokenizer):
    model = untied_qwen3(tokenizer)
    assert not isinstance(output_head_split(model), str)
    model.config.final_logit_softcapping = 30.0  # as Gemma 2 would: the head alone is not the logits
    reason = output_head_split(model)
    assert isinstance(reason, str) and "final_logit_softcapping=30.0" in reason
    calls, handle = count_head_calls(model.lm_head)
    inputs = ragged_batch(model.config.vocab_size)
    with torch.no_grad():
        logprobs, _ = sequence_logprobs(model, **inputs, num_completion_tokens=7, temperature=TEMPERATURE)
        ref, _ = logits_path(model, inputs, 7)
    handle.remove()
    assert calls == [3 * 8, 3 * 11]  # the model's own logits (logits_to_keep = T + 1), then the reference
    torch.testing.assert_close(logprobs, ref)
