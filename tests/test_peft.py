"""LoRA / QLoRA policies and a critic that shares the policy's base (consumer-GPU set-ups), on CPU."""

from __future__ import annotations

import builtins
import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from trl_sae import SAEPPOTrainer, forward_logprobs
from trl_sae.demo.tiny import build_tiny_qwen3, build_tiny_qwen3_critic
from trl_sae.trainer.critics.policy_and_critic import SharedBaseCritic

from .test_trainer import make_config, make_dataset, vowel_fraction


def lora_config(**overrides) -> LoraConfig:
    settings = dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0
    )
    settings.update(overrides)
    return LoraConfig(**settings)


def make_peft_trainer(tmp_path, tokenizer, model=None, peft_config="default", value_model=None, **overrides):
    return SAEPPOTrainer(
        model=model if model is not None else build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=make_config(tmp_path, learning_rate=1e-2, critic_learning_rate=1e-2, **overrides),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config() if peft_config == "default" else peft_config,
        value_model=value_model,
    )


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def changed(before: dict[str, torch.Tensor], module: torch.nn.Module) -> set[str]:
    return {name for name, p in module.named_parameters() if not torch.equal(before[name], p.detach())}


def test_lora_with_shared_critic_changes_only_adapters_and_the_value_head(tmp_path, tokenizer):
    trainer = make_peft_trainer(tmp_path, tokenizer)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(wrapper, SharedBaseCritic), "peft_config without a critic should default to 'shared'"
    before = snapshot(wrapper)
    trainer.train()
    moved = changed(before, wrapper)
    assert moved, "nothing trained"
    assert all(".default." in n or ".critic." in n or n.startswith("value_head") for n in moved), moved
    assert any(".default." in n for n in moved) and any(".critic." in n for n in moved)
    assert any(n.startswith("value_head") for n in moved)
    # one base model in memory: no separate critic or reference copy
    assert trainer.ref_model is None
    bases = {id(m) for m in wrapper.modules() if type(m).__name__ == "Qwen3ForCausalLM"}
    assert len(bases) == 1


def test_adapters_never_leak_gradients_into_each_other(tmp_path, tokenizer):
    trainer = make_peft_trainer(tmp_path, tokenizer)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(6)[None]}
    # make both adapters non-trivial so gradients can flow through either
    with torch.no_grad():
        for p in wrapper.actor_parameters() + wrapper.critic_parameters():
            p.normal_(0, 0.1)

    def grads_after(loss_of) -> tuple[bool, bool]:
        wrapper.zero_grad(set_to_none=True)
        (logprobs, _), values = wrapper(**inputs, num_completion_tokens=3)
        loss_of(logprobs, values).backward()
        has = lambda params: any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)  # noqa: E731
        base_grads = [p for n, p in wrapper.named_parameters() if "lora_" not in n and "value_head" not in n]
        assert all(p.grad is None for p in base_grads), "the frozen base received gradients"
        return has(wrapper.actor_parameters()), has(wrapper.critic_parameters())

    assert grads_after(lambda logprobs, values: logprobs.sum()) == (True, False)
    assert grads_after(lambda logprobs, values: values.sum()) == (False, True)


def test_reference_logprobs_are_the_base_models(tmp_path, tokenizer):
    model = build_tiny_qwen3(tokenizer, seed=0)
    pristine = copy.deepcopy(model)
    captured = {}

    class Capturing(SAEPPOTrainer):
        def _compute_advantages(self, batch):
            super()._compute_advantages(batch)
            captured["batch"] = batch

    trainer = Capturing(
        model=model,
        reward_funcs=vowel_fraction,
        args=make_config(tmp_path, kl_coef=0.05, max_steps=3, learning_rate=1e-2, critic_learning_rate=1e-2),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
    )
    trainer.train()
    batch = captured["batch"]
    expected, _ = forward_logprobs(
        pristine,
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        batch.completion_mask,
        temperature=1.0,
    )
    reference = trainer._reference_logprobs(batch)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    # ...while the trained policy has moved away from it
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    current, _ = forward_logprobs(
        policy,
        batch.prompt_ids,
        batch.prompt_mask,
        batch.completion_ids,
        batch.completion_mask,
        temperature=1.0,
    )
    assert (current - expected).abs().max() > 1e-3


def test_lora_policy_with_a_separate_critic(tmp_path, tokenizer):
    critic = build_tiny_qwen3_critic(tokenizer, seed=3)
    trainer = make_peft_trainer(tmp_path, tokenizer, value_model=critic)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert not isinstance(wrapper, SharedBaseCritic) and wrapper.critic is critic
    before = snapshot(critic)
    trainer.train()
    assert changed(before, critic)


def test_adapter_only_and_merged_saves_round_trip(tmp_path, tokenizer):
    trainer = make_peft_trainer(tmp_path, tokenizer, peft_config=lora_config(init_lora_weights=False))
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        expected = policy(ids).logits

    adapter_dir = tmp_path / "adapter"
    trainer.save_model(str(adapter_dir))
    assert (adapter_dir / "adapter_model.safetensors").exists()
    assert not (adapter_dir / "model.safetensors").exists(), "adapter-only save wrote full weights"
    assert (adapter_dir / "value_model" / "value_head.safetensors").exists()
    reloaded = PeftModel.from_pretrained(build_tiny_qwen3(tokenizer, seed=0), adapter_dir)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, atol=1e-5, rtol=1e-5)

    trainer.args.merge_adapters = True
    merged_dir = tmp_path / "merged"
    trainer.save_model(str(merged_dir))
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, expected, atol=1e-4, rtol=1e-4)
    # the merged save left the trained adapter in place
    with torch.no_grad():
        torch.testing.assert_close(policy(ids).logits, expected)


@pytest.fixture
def tiny_model_dir(tmp_path, tokenizer):
    path = tmp_path / "tiny-qwen3"
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def train_on_a_frozen_4bit_base(trainer: SAEPPOTrainer, trainable: tuple[str, ...]) -> set[str]:
    """Train ``trainer`` and return the names of the trained parameters that moved, asserting that its
    4-bit base stayed frozen: the optimizer holds only parameters whose names contain one of ``trainable``
    (or the value head's), and the base computes the same logits (adapters disabled) after training.

    The base is checked by what it computes, not by its bytes: on a CPU with AVX512-BF16, bitsandbytes
    repacks a 4-bit weight in place on its first inference-mode forward (a rollout) into its kernel's
    layout, so the stored tensors change while the weight they hold does not."""
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert wrapper.policy.get_base_model().is_loaded_in_4bit
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad(), wrapper.policy.disable_adapter():
        base_logits = wrapper.policy(ids).logits
    names = {id(p): n for n, p in wrapper.named_parameters()}
    optimized = {names[id(p)] for group in trainer.optimizer.param_groups for p in group["params"]}
    assert optimized and all(any(t in n for t in trainable) or n.startswith("value_head") for n in optimized)
    before = {n: p.detach().clone() for n, p in wrapper.named_parameters() if n in optimized}
    trainer.train()
    with torch.no_grad(), wrapper.policy.disable_adapter():
        torch.testing.assert_close(wrapper.policy(ids).logits, base_logits)
    return {
        n for n, p in wrapper.named_parameters() if n in before and not torch.equal(before[n], p.detach())
    }


def test_qlora_trains_adapters_on_a_frozen_4bit_base(tmp_path, tokenizer, tiny_model_dir):
    pytest.importorskip("bitsandbytes")
    trainer = SAEPPOTrainer(
        model=tiny_model_dir,
        reward_funcs=vowel_fraction,
        args=make_config(tmp_path, load_in_4bit=True, learning_rate=1e-2, critic_learning_rate=1e-2),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
    )
    moved = train_on_a_frozen_4bit_base(trainer, trainable=(".default.", ".critic."))
    assert any(".default." in n for n in moved) and any(".critic." in n for n in moved)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.tensor([[5, 6, 7, 8, 9]])

    trainer.args.merge_adapters = True
    trainer.save_model(str(tmp_path / "qmerged"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "qmerged")
    assert getattr(merged.config, "quantization_config", None) is None
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32
    # The merged model computes what the 4-bit policy computes. The base weights were repacked by the
    # CPU kernel above (when the CPU has AVX512-BF16), whose layout the plain dequantization misreads (its
    # merged weights were off by 144% relative); the packed kernel computes in bf16, hence the tolerance.
    wrapper.policy.eval()
    with torch.no_grad():
        expected = torch.log_softmax(wrapper.policy(ids).logits.float(), -1)
        got = torch.log_softmax(merged(ids).logits, -1)
    assert (expected - got).abs().max().item() < 2e-2


def test_peft_errors_are_clear(tmp_path, tokenizer, tiny_model_dir, monkeypatch):
    wrapped = get_peft_model(build_tiny_qwen3(tokenizer), lora_config())
    with pytest.raises(ValueError, match="PeftModel together with `peft_config`"):
        make_peft_trainer(tmp_path, tokenizer, model=wrapped)
    with pytest.raises(ValueError, match=r"value_model='shared'.*peft_config"):
        make_peft_trainer(tmp_path, tokenizer, peft_config=None, value_model="shared")
    with pytest.raises(ValueError, match="load_in_4bit"):
        make_peft_trainer(tmp_path, tokenizer, load_in_4bit=True)

    real_import = builtins.__import__

    def no_bitsandbytes(name, *args, **kwargs):
        if name == "bitsandbytes" or name.startswith("bitsandbytes."):
            raise ImportError("No module named 'bitsandbytes'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_bitsandbytes)
    with pytest.raises(ImportError, match=r"trl-sae\[quantization\]"):
        make_peft_trainer(tmp_path, tokenizer, model=tiny_model_dir, load_in_4bit=True)


def test_shared_critic_gradients_are_the_same_with_gradient_checkpointing(tmp_path, tokenizer):
    trainer = make_peft_trainer(tmp_path, tokenizer, activation_checkpointing=True)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert wrapper.is_gradient_checkpointing
    with torch.no_grad():
        for p in wrapper.actor_parameters() + wrapper.critic_parameters():
            p.normal_(0, 0.1)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(6)[None]}

    def gradients() -> list[torch.Tensor]:
        wrapper.train()
        wrapper.zero_grad(set_to_none=True)
        (logprobs, entropies), values = wrapper(**inputs, num_completion_tokens=3)
        (logprobs.sum() + entropies.sum() + (values**2).sum()).backward()
        return [p.grad.clone() for p in wrapper.actor_parameters() + wrapper.critic_parameters()]

    with_checkpointing = gradients()
    wrapper.gradient_checkpointing_disable()
    without = gradients()
    for a, b in zip(with_checkpointing, without):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # the critic adapter's gradient is non-zero: recomputation did not silently use the policy adapter
    assert any(g.abs().sum() > 0 for g in with_checkpointing[len(wrapper.actor_parameters()) :])


def test_checkpointed_shared_critic_trains_exactly_like_the_plain_one(tmp_path, tokenizer):
    """With checkpointing the actor and critic passes run (and recompute) under their own adapters."""
    results = []
    for checkpointing in (False, True):
        trainer = make_peft_trainer(
            tmp_path,
            tokenizer,
            activation_checkpointing=checkpointing,
            peft_config=lora_config(init_lora_weights=False),
        )
        trainer.train()
        wrapper = trainer.accelerator.unwrap_model(trainer.model)
        assert wrapper.is_gradient_checkpointing == checkpointing
        assert trainer.ppo_update.checkpointed_shared_critic() == checkpointing
        results.append((snapshot(wrapper), trainer.state.log_history[-1]))
    (plain, plain_log), (checkpointed, checkpointed_log) = results
    for name, value in plain.items():
        torch.testing.assert_close(checkpointed[name], value, atol=1e-5, rtol=1e-4, msg=name)
    assert checkpointed_log["loss/value"] == pytest.approx(plain_log["loss/value"], rel=1e-4)
    assert checkpointed_log["loss/policy"] == pytest.approx(plain_log["loss/policy"], rel=1e-3, abs=1e-6)


def test_deepspeed_keeps_one_backward_per_micro_batch_with_the_checkpointed_shared_critic(
    tmp_path, tokenizer, monkeypatch
):
    """DeepSpeed steps its optimizer inside a boundary micro-batch's backward: the actor-then-critic double
    backward used on one plain process would be two optimizer steps there."""
    from accelerate.utils import DistributedType

    trainer = make_peft_trainer(tmp_path, tokenizer, gradient_checkpointing=True)
    assert trainer.ppo_update.checkpointed_shared_critic()
    monkeypatch.setattr(trainer.accelerator.state, "distributed_type", DistributedType.DEEPSPEED)
    assert not trainer.ppo_update.checkpointed_shared_critic()


def test_modules_to_save_copies_of_the_policy_adapter_train(tmp_path, tokenizer):
    """``modules_to_save`` gives the policy adapter its own trainable copy of a module; with the shared critic
    that copy must be in the optimizer (it used to get gradients but never move)."""
    trainer = make_peft_trainer(tmp_path, tokenizer, peft_config=lora_config(modules_to_save=["model.norm"]))
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    copies = {n for n, _ in wrapper.named_parameters() if "modules_to_save.default" in n}
    assert copies, "the policy adapter has no modules_to_save copy"
    assert {id(p) for n, p in wrapper.named_parameters() if n in copies} <= {
        id(p) for p in wrapper.actor_parameters()
    }
    before = snapshot(wrapper)
    trainer.train()
    moved = changed(before, wrapper)
    assert copies & moved, "the policy's modules_to_save copy did not train"
    # the original module (the reference policy's, with adapters disabled) stays as it was
    assert not any("original_module" in n for n in moved), moved


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_lora_options_that_train_base_biases_are_refused(tmp_path, tokenizer, bias):
    with pytest.raises(ValueError, match=rf"peft_config.bias='{bias}'.*bias='none'"):
        make_peft_trainer(tmp_path, tokenizer, peft_config=lora_config(bias=bias))


def test_initialisations_that_rewrite_the_base_need_another_kl_reference(tmp_path, tokenizer):
    """PiSSA leaves a residual base: with adapters disabled it is not the starting policy, so a KL against it
    would pull the policy somewhere else from the first step."""
    pissa = lora_config(init_lora_weights="pissa")
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa'.*kl_coef=0"):
        make_peft_trainer(tmp_path, tokenizer, peft_config=pissa, kl_coef=0.05)
    trainer = make_peft_trainer(
        tmp_path, tokenizer, peft_config=lora_config(init_lora_weights="pissa"), kl_coef=0.0
    )
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        start = policy(input_ids=ids).logits
        with policy.disable_adapter():
            residual = policy(input_ids=ids).logits
    assert (start - residual).abs().max() > 1e-3  # why the refusal: the base alone is another model


def _reentrant_flags(module: torch.nn.Module) -> set:
    """``use_reentrant`` of every checkpointed decoder layer's checkpoint function in ``module``."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return {
        layer._gradient_checkpointing_func.keywords.get("use_reentrant")
        for layer in module.modules()
        if isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing
    }


@pytest.mark.parametrize("critic", ["shared", "separate"])
def test_gradient_checkpointing_kwargs_hold_across_rollouts(tmp_path, tokenizer, critic):
    """TRL's unwrap_model_for_generation switches checkpointing off for generate and back on with no kwargs;
    the configured ``use_reentrant=True`` must still be what every update after the first rollout uses (the
    shared critic's pass re-enables checkpointing too)."""
    trainer = make_peft_trainer(
        tmp_path,
        tokenizer,
        peft_config="default" if critic == "shared" else None,
        max_steps=2,
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": True},
    )
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert _reentrant_flags(wrapper) == {True}
    seen = []
    run = trainer.ppo_update.run

    def recording_run(*args, **kwargs):
        seen.append(_reentrant_flags(wrapper))
        return run(*args, **kwargs)

    trainer.ppo_update.run = recording_run
    trainer.train()
    assert seen == [{True}, {True}]  # every update, each after a rollout
    assert _reentrant_flags(wrapper) == {True}


DEPRECATED_CHECKPOINTING = (
    "is_gradient_checkpointing",
    "gradient_checkpointing_enable",
    "gradient_checkpointing_disable",
)


@pytest.mark.parametrize("peft_config", ["default", None])
def test_checkpointed_training_calls_no_deprecated_checkpointing_name(
    tmp_path, tokenizer, monkeypatch, peft_config
):
    """transformers 5.x deprecates the gradient_checkpointing_* names (FutureWarning); our code calls the
    activation_checkpointing_* ones. The warning points into transformers, so the caller is read off the stack."""
    import traceback
    import warnings

    callers = []
    warn = warnings.warn

    def recording_warn(message, category=None, *args, **kwargs):
        if category is FutureWarning and any(
            f"`{name}` is deprecated" in str(message) for name in DEPRECATED_CHECKPOINTING
        ):
            frames = [f for f in traceback.extract_stack()[:-1] if "/transformers/" not in f.filename]
            callers.append(f"{frames[-1].filename}:{frames[-1].lineno}: {message}")
        return warn(message, category, *args, **kwargs)

    monkeypatch.setattr(warnings, "warn", recording_warn)
    trainer = make_peft_trainer(
        tmp_path, tokenizer, peft_config=peft_config, max_steps=1, gradient_checkpointing=True
    )
    trainer.train()
    assert [c for c in callers if "/trl_sae/" in c] == []
