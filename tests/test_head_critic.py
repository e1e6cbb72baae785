"""The head critic (``value_model="head"``): a value head on the policy's own forward, on CPU."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerCallback

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.generation.inputs import sequence_inputs
from trl_sae.hub import estimator_settings, save_and_push
from trl_sae.trainer.checkpoints.folders import model_setup
from trl_sae.trainer.critics.head import HeadCritic, scale_gradient

from .test_peft import (  # noqa: F401 (tiny_model_dir is a fixture)
    lora_config,
    make_peft_trainer,
    tiny_model_dir,
    train_on_a_frozen_4bit_base,
)
from .test_trainer import make_config, make_dataset, parameters_of, vowel_fraction


def head_trainer(tmp_path, tokenizer, peft_config="default", **overrides) -> SAEPPOTrainer:
    return make_peft_trainer(tmp_path, tokenizer, peft_config=peft_config, value_model="head", **overrides)


def micro_inputs() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_min(0)}


def test_scale_gradient_is_identity_forward_and_scales_backward():
    x = torch.randn(3, 4, requires_grad=True)
    for scale in (0.0, 0.25, 1.0):
        y = scale_gradient(x, scale)
        torch.testing.assert_close(y, x)
        if scale == 0:
            assert not y.requires_grad  # detached: no backward through the trunk at all
            continue
        (grad,) = torch.autograd.grad((y * 3.0).sum(), x)
        torch.testing.assert_close(grad, torch.full_like(x, 3.0 * scale))


@pytest.mark.parametrize("scale", [0.0, 0.5, 1.0])
def test_value_gradient_reaches_the_trunk_only_as_configured(tmp_path, tokenizer, scale):
    trainer = head_trainer(tmp_path, tokenizer, value_head_trunk_grad_scale=scale)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(wrapper, HeadCritic)
    with torch.no_grad():  # a non-zero head and adapter, so gradients can flow either way
        for p in wrapper.actor_parameters() + wrapper.critic_parameters():
            p.normal_(0, 0.1)

    def adapter_grads() -> torch.Tensor:
        wrapper.zero_grad(set_to_none=True)
        _, values = wrapper(**micro_inputs(), num_completion_tokens=3)
        values.square().sum().backward()  # a value-loss-only backward
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in wrapper.critic_parameters())
        grads = [p.grad for p in wrapper.actor_parameters()]
        if scale == 0:
            assert all(g is None for g in grads), "a detached head passed gradients into the adapter"
            return torch.zeros(())
        return torch.cat([g.flatten() for g in grads])

    got = adapter_grads()
    if scale > 0:
        wrapper.trunk_grad_scale = 1.0
        full = adapter_grads()
        assert full.abs().sum() > 0
        torch.testing.assert_close(got, scale * full)
    base = [p for n, p in wrapper.named_parameters() if "lora_" not in n and "value_head" not in n]
    assert all(p.grad is None for p in base), "the frozen base received gradients"


def test_one_forward_gives_the_policys_logprobs_and_the_heads_values(tmp_path, tokenizer):
    trainer = head_trainer(tmp_path, tokenizer)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        wrapper.value_head.weight.normal_(0, 0.1)
    calls = []
    handle = wrapper._decoder().register_forward_hook(lambda *a: calls.append(1))
    (logprobs, _), values = wrapper(**micro_inputs(), num_completion_tokens=3)
    handle.remove()
    assert len(calls) == 1, "the policy and the critic must share one decoder pass"
    alone, _ = wrapper.policy_logprobs(**micro_inputs(), num_completion_tokens=3)
    torch.testing.assert_close(logprobs, alone)
    hidden = wrapper._decoder()(**micro_inputs(), use_cache=False).last_hidden_state
    torch.testing.assert_close(values, wrapper.value_head(hidden[:, 2:5]).squeeze(-1))


class Capturing(SAEPPOTrainer):
    def _compute_advantages(self, batch):
        super()._compute_advantages(batch)
        self.captured = batch


def captured_and_recomputed_values(trainer, monkeypatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train ``trainer`` (a :class:`Capturing`, one step) with a non-zero head; ``(values, expected, mask)``:
    the values its rollout captured and the head critic's teacher-forced values of the same rows with the
    weights the rollout used. Fails if a value pass of its own ran."""
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        wrapper.value_head.weight.normal_(0, 0.5)
        wrapper.value_head.bias.fill_(0.3)
    critic_passes = []
    monkeypatch.setattr(wrapper, "critic_values", lambda *a, **k: critic_passes.append(1))
    head_before = {k: v.clone() for k, v in wrapper.value_head.state_dict().items()}
    adapter_before = [p.detach().clone() for p in wrapper.actor_parameters()]
    trainer.train()
    assert not critic_passes, "a separate value pass ran"
    batch = trainer.captured
    # Recompute with the weights the rollout used.
    after = {k: v.clone() for k, v in wrapper.value_head.state_dict().items()}
    adapter_after = [p.detach().clone() for p in wrapper.actor_parameters()]
    with torch.no_grad():
        wrapper.value_head.load_state_dict(head_before)
        for p, v in zip(wrapper.actor_parameters(), adapter_before):
            p.copy_(v)
        inputs = sequence_inputs(
            batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        )
        wrapper.eval()
        with trainer.accelerator.autocast():
            expected = HeadCritic.critic_values(
                wrapper, **inputs, num_completion_tokens=batch.completion_ids.shape[1]
            )
        wrapper.value_head.load_state_dict(after)
        for p, v in zip(wrapper.actor_parameters(), adapter_after):
            p.copy_(v)
    mask = batch.mask
    assert mask.any() and batch.values[mask].abs().max() > 0.05
    assert (batch.values[~mask] == 0).all()
    return batch.values, expected.float(), mask


@pytest.mark.parametrize(
    ("bf16", "recompute", "layer", "chunks"),
    [
        (False, False, None, None),
        (True, True, None, None),
        (False, False, 0, None),
        (False, True, -2, None),
        (False, False, None, 2),
    ],
    ids=["generate", "recompute-bf16", "generate-layer0", "recompute-layer-2", "generate-prefill-chunks"],
)
def test_rollout_values_equal_a_teacher_forced_head_recompute(
    tmp_path, tokenizer, bf16, recompute, layer, chunks, monkeypatch
):
    """The values are captured at the decoding steps (float32) or in the log-prob recompute (bf16, or forced
    here in float32); either way they are the head applied to the teacher-forced hidden states of the layer it
    reads, and no value pass of its own runs. Also when the checkpoint's generation config prefills in
    chunks (``prefill_chunk_size``: generate would call the decoder once per chunk of the prompt)."""
    if recompute and not bf16:  # the teacher-forced recompute in float32, as under vLLM
        monkeypatch.setattr(
            "trl_sae.trainer.parts.rollout.needs_teacher_forced_old_logprobs", lambda *a: True
        )
    model = build_tiny_qwen3(tokenizer, seed=0)
    model.generation_config.prefill_chunk_size = chunks  # as a generation_config.json may set it
    trainer = Capturing(
        model=model,
        reward_funcs=vowel_fraction,
        args=make_config(
            tmp_path,
            max_steps=1,
            bf16=bf16,
            num_ppo_epochs=1,
            local_rollout_forward_batch_size=3,
            response_length=12,
            value_head_layer=layer,
        ),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
        value_model="head",
    )
    assert trainer.accelerator.unwrap_model(trainer.model).layer == (None if layer is None else 0)
    values, expected, mask = captured_and_recomputed_values(trainer, monkeypatch)
    tolerance = 0.05 if bf16 else 1e-4
    torch.testing.assert_close(values[mask], expected[mask], atol=tolerance, rtol=tolerance)


def test_filter_groups_keeps_each_rows_captured_values(tmp_path, tokenizer, monkeypatch):
    """Dynamic sampling with the head critic: the rows kept from several generation rounds carry the values
    captured for them (the head on layer 0 of their own teacher-forced pass)."""
    from .test_dynamic_sampling import odd_prompts_differ

    trainer = Capturing(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=odd_prompts_differ,
        args=make_config(
            tmp_path, max_steps=1, num_ppo_epochs=1, filter_groups=True, value_head_layer=0, logging_steps=1
        ),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
        value_model="head",
    )
    values, expected, mask = captured_and_recomputed_values(trainer, monkeypatch)
    rounds = [e["dynamic_sampling/generation_rounds"] for e in trainer.state.log_history if "episode" in e]
    assert rounds and rounds[0] > 1, "the data should make the step draw a second round"
    assert values.shape[0] == trainer.args.local_batch_size
    torch.testing.assert_close(values[mask], expected[mask], atol=1e-4, rtol=1e-4)


def untied_tiny_qwen3(tokenizer, num_layers: int = 3) -> Qwen3ForCausalLM:
    """The tiny Qwen3 with ``num_layers`` layers and an LM head of its own (the fixture ties it to the
    embedding, which sits below every layer)."""
    config = build_tiny_qwen3(tokenizer).config.to_dict()
    config.update(num_hidden_layers=num_layers, tie_word_embeddings=False, layer_types=None)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**config))


@pytest.mark.parametrize("layer", [0, 1, -1, -3])
def test_an_intermediate_layers_values_are_the_head_on_its_normalised_output(tokenizer, layer):
    policy = untied_tiny_qwen3(tokenizer).eval()
    policy.config.tie_last_hidden_states = (
        False  # hidden_states[-1]: the last layer's output, before the norm
    )
    wrapper = HeadCritic(policy, layer=layer)
    with torch.no_grad():
        wrapper.value_head.weight.normal_(0, 0.5)
        wrapper.value_head.bias.fill_(0.3)
    (_, _), values = wrapper(**micro_inputs(), num_completion_tokens=3)
    hidden = policy.model(**micro_inputs(), output_hidden_states=True).hidden_states
    assert len(hidden) == 4  # the embeddings, then each layer's output
    out = hidden[1 + layer % 3][:, 2:5]
    normalised = out / out.pow(2).mean(-1, keepdim=True).add(policy.config.rms_norm_eps).sqrt()
    expected = normalised @ wrapper.value_head.weight[0] + 0.3
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=1e-5)
    assert wrapper.critic_values(**micro_inputs(), num_completion_tokens=3).tolist() == values.tolist()


@pytest.mark.parametrize("layer", [1, None])
def test_the_value_gradient_reaches_the_layers_up_to_the_heads_and_no_further(tokenizer, layer):
    """Trunk scale 1, a full policy: the value loss reaches every weight of layers 0..k (and the embedding
    below them) and nothing above: the later layers, the final norm and the LM head get no gradient at all."""
    policy = untied_tiny_qwen3(tokenizer, num_layers=3)
    wrapper = HeadCritic(policy, trunk_grad_scale=1.0, layer=layer)
    with torch.no_grad():
        wrapper.value_head.weight.normal_(0, 0.5)
    _, values = wrapper(**micro_inputs(), num_completion_tokens=3)
    values.square().sum().backward()
    top = 2 if layer is None else layer
    for name, p in policy.named_parameters():
        reached = p.grad is not None and p.grad.abs().sum() > 0
        below = name.startswith("model.embed_tokens") or any(
            name.startswith(f"model.layers.{i}.") for i in range(top + 1)
        )
        if layer is None:  # the final hidden states: everything but the LM head
            below = below or name.startswith("model.norm")
        if below:
            assert reached, f"{name} got no value gradient"
        elif not below:
            assert p.grad is None, f"{name} is above the head's layer but got a value gradient"


def test_activation_checkpointing_leaves_an_intermediate_heads_value_gradient_unchanged(
    tokenizer, monkeypatch
):
    """transformers checkpoints a layer's forward inside its hooks: the layer's hook sees its output in the
    graph, the backward's recompute does not call it, and the value gradient into the layers up to the head's
    is the one without checkpointing."""
    from trl_sae.trainer.critics import head as head_critic

    calls = []
    normalise = head_critic.rms_normalise
    monkeypatch.setattr(head_critic, "rms_normalise", lambda *a: calls.append(1) or normalise(*a))

    def value_gradients(reentrant: bool | None) -> dict[str, torch.Tensor]:
        policy = untied_tiny_qwen3(tokenizer, num_layers=3)
        if reentrant is not None:
            policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            policy.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
        policy.train()
        wrapper = HeadCritic(policy, trunk_grad_scale=1.0, layer=1)
        torch.manual_seed(1)
        with torch.no_grad():
            wrapper.value_head.weight.normal_(0, 0.5)
        _, values = wrapper(**micro_inputs(), num_completion_tokens=3)
        calls.clear()
        values.square().sum().backward()  # recomputes layers 0..2 when checkpointing
        assert not calls, "the backward's recompute called the value hook"
        return {n: p.grad for n, p in policy.named_parameters() if p.grad is not None}

    plain = value_gradients(None)
    assert any("layers.1." in n for n in plain) and not any("layers.2." in n for n in plain)
    for reentrant in (False, True):
        checkpointed = value_gradients(reentrant)
        assert checkpointed.keys() == plain.keys()
        for name, grad in plain.items():
            torch.testing.assert_close(checkpointed[name], grad, msg=f"{name} (use_reentrant={reentrant})")


def test_a_value_head_layer_out_of_range_is_refused_when_the_trainer_is_built(tmp_path, tokenizer):
    for layer in (2, -3):  # the tiny model has 2 layers: 0, 1 (or -2, -1)
        with pytest.raises(
            ValueError,
            match=rf"SAEPPOConfig.value_head_layer={layer} is out of range: the policy has 2 decoder "
            r"layers; pass an int in \[-2, 1\]",
        ):
            head_trainer(tmp_path, tokenizer, value_head_layer=layer)


@pytest.mark.parametrize("value_model", [None, "shared"])
def test_a_value_head_layer_without_the_head_critic_is_refused(tmp_path, tokenizer, value_model):
    with pytest.raises(ValueError, match=r"value_head_layer=0 picks .* pass value_model='head' or leave"):
        make_peft_trainer(tmp_path, tokenizer, value_model=value_model, value_head_layer=0)


@pytest.mark.parametrize("layer", [1.0, True, "1"])
def test_a_value_head_layer_that_is_no_int_is_refused(tmp_path, layer):
    with pytest.raises(ValueError, match=r"SAEPPOConfig.value_head_layer: must be an int"):
        SAEPPOConfig(output_dir=str(tmp_path), value_head_layer=layer)


def test_the_card_and_the_model_setup_name_the_heads_layer(tmp_path, tokenizer):
    assert (
        "value_head_layer" not in estimator_settings(SAEPPOConfig(output_dir=str(tmp_path)))["optimisation"]
    )
    args = SAEPPOConfig(output_dir=str(tmp_path), value_head_layer=-1)
    assert estimator_settings(args)["optimisation"]["value_head_layer"] == -1
    wrapper = HeadCritic(build_tiny_qwen3(tokenizer), layer=-1)
    assert model_setup(wrapper)["critic"] == (
        "a value head on the policy's decoder layer 1 of 0..1 (value_model='head', value_head_layer=1)"
    )


@pytest.mark.parametrize("scale", [-0.1, 1.5, float("nan")])
def test_a_trunk_grad_scale_outside_0_1_is_refused(tmp_path, scale):
    with pytest.raises(
        ValueError, match=r"SAEPPOConfig.value_head_trunk_grad_scale: must be (in \[0, 1\]|finite)"
    ):
        SAEPPOConfig(output_dir=str(tmp_path), value_head_trunk_grad_scale=scale)


@pytest.mark.parametrize("value_model", [None, "shared"])
def test_a_trunk_grad_scale_without_the_head_critic_is_refused(tmp_path, tokenizer, value_model):
    with pytest.raises(ValueError, match=r"value_head_trunk_grad_scale=0.5 .* pass value_model='head'"):
        make_peft_trainer(tmp_path, tokenizer, value_model=value_model, value_head_trunk_grad_scale=0.5)


def test_the_head_critic_without_a_critic_estimator_is_refused(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"`value_model` was given but advantage_estimator='grpo'"):
        head_trainer(tmp_path, tokenizer, advantage_estimator="grpo")


class Snapshots(TrainerCallback):
    def __init__(self, wrapper) -> None:
        self.wrapper, self.after_step = wrapper, []

    def on_step_end(self, args, state, control, **kwargs):
        self.after_step.append(parameters_of(self.wrapper))


def test_warmup_trains_the_head_only_then_both_with_gradient_checkpointing(tmp_path, tokenizer):
    """value_warmup_steps train the value head alone, even with trunk gradients on; then the adapter moves
    (policy and value loss), the frozen base never; the critic's explained variance is logged."""
    trainer = head_trainer(
        tmp_path,
        tokenizer,
        value_warmup_steps=1,
        value_head_trunk_grad_scale=1.0,
        gradient_checkpointing=True,
        max_steps=2,
    )
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert wrapper.is_gradient_checkpointing
    snapshots = Snapshots(wrapper)
    trainer.add_callback(snapshots)
    before = parameters_of(wrapper)
    trainer.train()
    warm, trained = snapshots.after_step
    moved = lambda a, b: {n for n in a if not torch.equal(a[n], b[n])}  # noqa: E731
    assert moved(before, warm) == {"value_head.weight", "value_head.bias"}
    second = moved(warm, trained)
    assert {"value_head.weight", "value_head.bias"} <= second
    assert any("lora_" in n for n in second)
    assert all("lora_" in n or n.startswith("value_head") for n in second), second
    ev = [
        e["critic/explained_variance"] for e in trainer.state.log_history if "critic/explained_variance" in e
    ]
    assert len(ev) == 2 and all(torch.isfinite(torch.tensor(ev)))
    optimized = {id(p): g["initial_lr"] for g in trainer.optimizer.param_groups for p in g["params"]}
    assert {optimized[id(p)] for p in wrapper.critic_parameters()} == {trainer.args.critic_learning_rate}
    assert {optimized[id(p)] for p in wrapper.actor_parameters()} == {trainer.args.learning_rate}


def test_a_full_policy_trains_its_weights_from_the_policy_loss_and_the_head_beside(tmp_path, tokenizer):
    trainer = head_trainer(tmp_path, tokenizer, peft_config=None, max_steps=1)
    wrapper = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(wrapper, HeadCritic) and trainer.value_model is wrapper
    before = parameters_of(wrapper)
    trainer.train()
    after = parameters_of(wrapper)
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert {"value_head.weight", "value_head.bias"} <= moved and any(n.startswith("policy.") for n in moved)


def test_qlora_trains_the_adapter_and_the_head_on_a_frozen_4bit_base(tmp_path, tokenizer, tiny_model_dir):  # noqa: F811
    pytest.importorskip("bitsandbytes")
    trainer = SAEPPOTrainer(
        model=tiny_model_dir,
        reward_funcs=vowel_fraction,
        args=make_config(
            tmp_path, load_in_4bit=True, max_steps=1, learning_rate=1e-2, critic_learning_rate=1e-2
        ),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
        value_model="head",
    )
    moved = train_on_a_frozen_4bit_base(trainer, trainable=(".default.",))
    assert {"value_head.weight", "value_head.bias"} <= moved and any(".default." in n for n in moved)


def _resumable(output_dir, tokenizer, max_steps: int = 2, layer: int | None = None) -> SAEPPOTrainer:
    return SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=vowel_fraction,
        args=make_config(
            output_dir.parent,
            output_dir=str(output_dir),
            max_steps=max_steps,
            save_strategy="steps",
            save_steps=1,
            value_head_trunk_grad_scale=0.5,
            merge_adapters=True,
            value_head_layer=layer,
        ),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=lora_config(),
        value_model="head",
    )


@pytest.mark.parametrize("layer", [None, 0])
def test_checkpoints_resume_exactly_and_save_the_head(tmp_path, tokenizer, layer):
    uninterrupted = _resumable(tmp_path / "a" / "out", tokenizer, layer=layer)
    uninterrupted.train()
    expected = parameters_of(uninterrupted.accelerator.unwrap_model(uninterrupted.model))
    resumed_dir = tmp_path / "b" / "out"
    shutil.copytree(tmp_path / "a" / "out", resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoint-2")
    if layer is not None:  # the head's layer is part of the checkpoint's model set-up: another is refused
        other = _resumable(resumed_dir, tokenizer, layer=None)
        with pytest.raises(
            ValueError,
            match=r"another model set-up.*critic \"a value head on the policy's decoder layer 0 of",
        ):
            other.train(resume_from_checkpoint=True)
    resumed = _resumable(resumed_dir, tokenizer, layer=layer)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.accelerator.unwrap_model(resumed.model).layer == layer
    wrapper = resumed.accelerator.unwrap_model(resumed.model)
    got = parameters_of(wrapper)
    assert {n for n in expected if n.startswith("value_head")} == {"value_head.weight", "value_head.bias"}
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)
    # save_value_model: the head alone in value_model/, beside the merged policy
    saved = load_file(str(resumed_dir / "checkpoint-2" / "value_model" / "value_head.safetensors"))
    torch.testing.assert_close(saved["weight"], wrapper.value_head.weight.detach())
    torch.testing.assert_close(saved["bias"], wrapper.value_head.bias.detach())
    assert os.path.getsize(resumed_dir / "checkpoint-2" / "value_model" / "value_head.safetensors") < 4096
    assert (resumed_dir / "checkpoint-2" / "model.safetensors").is_file()  # merged


def test_the_hub_card_names_the_value_head_critic(tmp_path, tokenizer):
    trainer = head_trainer(tmp_path, tokenizer, max_steps=1, value_head_trunk_grad_scale=0.25)
    trainer.train()
    card = Path(save_and_push(trainer, tmp_path / "card", push=False)["card"]).read_text()
    assert "| `critic` | a value head on the policy's own hidden states (value_model='head') |" in card
    assert "| `value_head_trunk_grad_scale` | 0.25 |" in card


def test_value_capture_refuses_a_chunked_prefill():
    """Decoder calls of (B, 3), (B, 2) then one position each: a prompt prefilled in two chunks. Reading each
    call's last position would shift every value by one step; the capture refuses instead."""
    from trl_sae.trainer.critics.head import ValueCapture

    capture = ValueCapture()
    capture.calls = [torch.zeros(2, 3), torch.ones(2, 2), torch.full((2, 1), 2.0), torch.full((2, 1), 3.0)]
    with pytest.raises(ValueError, match=r"prefill_chunk_size"):
        capture.per_step(3)
    capture.calls = [torch.ones(2, 5), torch.full((2, 1), 2.0), torch.full((2, 1), 3.0)]
    assert capture.per_step(3).tolist() == [[1.0, 2.0, 3.0]] * 2
