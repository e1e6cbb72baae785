"""Mixed precision: every forward of the policy runs at the update's precision (so the first PPO ratio is 1),
fp16 trains with a gradient scaler (on CPU too) and clips actor and critic with one unscale."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState

import trl_sae.trainer.parts.update as update_module
from trl_sae import SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.trainer.rollout_batch import RolloutBatch
from trl_sae.trainer.setup.precision import clip_grad_norms

from .test_trainer import make_dataset, make_trainer


def count_output_dtypes(module: torch.nn.Module) -> Counter:
    counts: Counter = Counter()
    module.register_forward_hook(lambda _module, _inputs, output: counts.update([output.dtype]))
    return counts


def record_log_ratios(monkeypatch) -> list[torch.Tensor]:
    """|log r| on the valid tokens of every clipped_policy_loss call, in order."""
    ratios: list[torch.Tensor] = []
    original = update_module.clipped_policy_loss

    def recording(logprobs, old_logprobs, advantages, mask, *args, **kwargs):
        ratios.append((logprobs - old_logprobs)[mask].detach().abs())
        return original(logprobs, old_logprobs, advantages, mask, *args, **kwargs)

    monkeypatch.setattr(update_module, "clipped_policy_loss", recording)
    return ratios


@pytest.mark.parametrize(
    ("weights_dtype", "bf16"),
    [(torch.float32, True), (torch.bfloat16, False)],
    ids=["bf16-autocast-float32-weights", "bfloat16-weights"],
)
def test_every_policy_forward_runs_at_the_update_precision_and_the_first_ratio_is_one(
    tmp_path, tokenizer, monkeypatch, weights_dtype, bf16
):
    # Micro-batches of 4 rows in the update against a rollout forward over all 8: the old log-probs must
    # not depend on how rows are grouped. kl_coef > 0 adds the reference pass; eval_dataset the evaluation.
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        model=build_tiny_qwen3(tokenizer, seed=0).to(weights_dtype),
        max_steps=1,
        bf16=bf16,
        num_ppo_epochs=1,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        kl_coef=0.1,
    )
    trainer.eval_dataset = trainer._prepare_prompt_dataset(make_dataset(n=4), "eval_dataset")
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    policy_dtypes = count_output_dtypes(unwrapped.policy.model.layers[0].mlp)
    reference_dtypes = count_output_dtypes(trainer.ref_model.model.layers[0].mlp)
    critic_dtypes = count_output_dtypes(unwrapped.critic.model.layers[0].mlp)
    ratios = record_log_ratios(monkeypatch)
    trainer.train()
    trainer.evaluate()
    # generation (1 prompt + 8 new tokens), the old-log-prob recompute, 2 update micro-batches, evaluation
    assert sum(policy_dtypes.values()) >= 12
    assert policy_dtypes == Counter({torch.bfloat16: sum(policy_dtypes.values())}), policy_dtypes
    assert set(reference_dtypes) == {torch.bfloat16}, reference_dtypes
    assert set(critic_dtypes) == {torch.bfloat16}, critic_dtypes
    assert next(unwrapped.policy.parameters()).dtype == weights_dtype  # autocast, not a cast of the weights
    # The first mini-batch's ratio is exactly the one a float32 run has: 1.
    assert len(ratios) == 2
    assert ratios[0].max().item() < 1e-6, f"first |log r| max {ratios[0].max().item():.3g}"


def test_fp16_trains_with_a_gradient_scaler_and_clips_actor_and_critic(tmp_path, tokenizer, monkeypatch):
    # accelerate leaves fp16 on CPU in float32 (no autocast, no scaler); the trainer gives it both, as on a
    # GPU. Clipping actor and critic separately then needs one unscale of the shared optimizer.
    trainer = make_trainer(tmp_path, tokenizer, max_steps=2, fp16=True, max_grad_norm=0.01, num_ppo_epochs=1)
    assert trainer.accelerator.scaler is not None, "fp16 on CPU would train in float32"
    norms: list[list[torch.Tensor | None]] = []
    original = update_module.clip_grad_norms

    def recording(accelerator, groups, max_norm):
        groups = [list(group) for group in groups]
        result = original(accelerator, groups, max_norm)
        after = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in groups]
        norms.append([*result, *after])
        return result

    monkeypatch.setattr(update_module, "clip_grad_norms", recording)
    update_dtypes = count_output_dtypes(
        trainer.accelerator.unwrap_model(trainer.model).policy.model.layers[0].mlp
    )
    trainer.train()
    assert set(update_dtypes) == {torch.float16}, update_dtypes
    logs = [entry for entry in trainer.state.log_history if "loss/value" in entry]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(e["loss/value"])) for e in logs)
    assert len(norms) == 2  # one mini-batch per step
    finite = [step for step in norms if all(torch.isfinite(norm) for norm in step)]  # else a skipped step
    assert finite
    for actor_before, critic_before, actor_after, critic_after in finite:
        # each group on its own: clipped to max_grad_norm when above it, untouched below
        assert actor_after.item() == pytest.approx(min(actor_before.item(), 0.01), rel=1e-3)
        assert critic_after.item() == pytest.approx(min(critic_before.item(), 0.01), rel=1e-3)
    assert any(step[0] > 0.01 and step[1] > 0.01 for step in finite)  # both groups were clipped


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_clipping_each_group_matches_accelerates_clip_grad_norm(mixed_precision):
    AcceleratorState._reset_state(
        reset_partial_state=True
    )  # as TrainingArguments does before its Accelerator
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    generator = torch.Generator().manual_seed(0)
    actor, critic = torch.nn.Linear(6, 5), torch.nn.Linear(4, 1)
    for parameter in [*actor.parameters(), *critic.parameters()]:
        parameter.grad = torch.randn(parameter.shape, generator=generator) * 3
    saved = [p.grad.clone() for p in [*actor.parameters(), *critic.parameters()]]
    norms = clip_grad_norms(accelerator, [list(actor.parameters()), list(critic.parameters()), []], 0.5)
    clipped = [p.grad.clone() for p in [*actor.parameters(), *critic.parameters()]]
    for parameter, grad in zip([*actor.parameters(), *critic.parameters()], saved):
        parameter.grad = grad.clone()
    expected = [accelerator.clip_grad_norm_(list(m.parameters()), 0.5) for m in (actor, critic)]
    assert norms[2] is None
    torch.testing.assert_close(torch.stack(norms[:2]), torch.stack(expected))
    assert min(expected) > 0.5  # both groups were clipped
    for got, want in zip(clipped, [p.grad for p in [*actor.parameters(), *critic.parameters()]]):
        torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------------
# Whitening over all processes (tests/test_distributed.py runs the 2-rank half)
# ------------------------------------------------------------------------------------------------
WHITENING_ROWS = 6  # rank 0 holds rows 0-3 (up to 6 tokens), rank 1 rows 4-5 (up to 4): uneven work


def whitening_batch(trainer, rows: slice) -> RolloutBatch:
    """``rows`` of six fixed rollouts (scores, values, log-probs, boundaries), trimmed to their longest row."""
    generator = torch.Generator().manual_seed(7)
    lengths = torch.tensor([6, 2, 5, 3, 4, 1])
    full = {
        "logprobs": -torch.rand(WHITENING_ROWS, 6, generator=generator) * 3,
        "ref_logprobs": -torch.rand(WHITENING_ROWS, 6, generator=generator) * 3,
        "values": torch.randn(WHITENING_ROWS, 6, generator=generator),
    }
    boundaries = torch.rand(WHITENING_ROWS, 6, generator=generator) < 0.4
    scores = torch.tensor([1.0, 0.0, 2.5, -1.0, 0.5, 3.0])[rows]
    mask = (torch.arange(6) < lengths[:, None])[rows]
    width = int(mask.sum(dim=1).max())
    mask = mask[:, :width]
    picked = {name: torch.where(mask, value[rows, :width], torch.zeros(())) for name, value in full.items()}
    count = mask.shape[0]
    batch = RolloutBatch(
        prompts=["p"] * count,
        columns={},
        prompt_ids=torch.ones(count, 2, dtype=torch.long),
        prompt_mask=torch.ones(count, 2, dtype=torch.long),
        completion_ids=torch.ones(count, width, dtype=torch.long),
        completion_mask=mask.long(),
        logprobs=picked["logprobs"],
        entropies=torch.zeros(count, width),
        is_truncated=torch.zeros(count, dtype=torch.bool),
        scores=scores,
        values=picked["values"],
        ref_logprobs=picked["ref_logprobs"],
        boundaries=boundaries[rows, :width] & mask,
    )
    trainer._compute_advantages(batch)
    return batch


def whitening_trainer(output_dir, tokenizer):
    return make_trainer(Path(output_dir), tokenizer, max_steps=1, whiten_rewards=True, kl_coef=0.1)


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, torch.float32])
def test_a_4bit_policy_is_recomputed_by_its_compute_dtype_not_its_packed_weights(
    tmp_path, tokenizer, monkeypatch, compute_dtype
):
    """bitsandbytes' 4-bit layers store packed uint8 and compute in ``bnb_4bit_compute_dtype``: with bf16
    compute and mixed_precision="no" the old log-probs must be recomputed (before: skipped, as no floating
    weight was below float32); with float32 compute nothing needs it."""
    pytest.importorskip("bitsandbytes")
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from trl_sae.trainer.setup.precision import needs_teacher_forced_old_logprobs

    from .test_trainer import make_config

    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(tmp_path / "tiny")
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype
    )
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", quantization_config=quantization)
    assert {p.dtype for p in model.parameters()} == {torch.uint8, torch.float32}  # packed + float32 rest
    trainer = SAEPPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=make_config(tmp_path, max_steps=1, bf16=False, num_ppo_epochs=1),
        train_dataset=make_dataset(),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.accelerator.mixed_precision == "no"
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    below_float32 = compute_dtype != torch.float32
    assert needs_teacher_forced_old_logprobs(trainer.accelerator, unwrapped.policy) == below_float32
    recomputes = []
    teacher_forced = trainer.rollouts.teacher_forced
    monkeypatch.setattr(
        trainer.rollouts, "teacher_forced", lambda *a, **k: recomputes.append(1) or teacher_forced(*a, **k)
    )
    ratios = record_log_ratios(monkeypatch)
    trainer.train()
    assert len(recomputes) == int(below_float32)  # the rollout's old log-probs, teacher-forced
    assert ratios[0].max().item() < 1e-6
