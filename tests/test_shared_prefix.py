"""A shared-base critic computes the decoder layers no adapter touches once per set of passes on the same rows,
with results identical to computing them in every pass."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from peft import LoraConfig

from trl_sae import SAEPPOTrainer
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.trainer.critics.policy_and_critic import SharedBaseCritic
from trl_sae.trainer.critics.shared_prefix import PrefixSharing, unadapted_prefix_layers
from trl_sae.trainer.setup.adapters import adapter_parameters

from .scenarios import in_the_ddp_launch
from .test_trainer import make_config, make_dataset, vowel_fraction

LAYERS = 4


def last_layers_lora(count: int = 2, **overrides) -> LoraConfig:
    """LoRA on the attention and MLP projections of the last ``count`` of the tiny model's layers."""
    settings = dict(
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
        layers_to_transform=list(range(LAYERS - count, LAYERS)),
    )
    settings.update(overrides)
    return LoraConfig(**settings)


def make_trainer(
    tmp_path, tokenizer, share: bool, peft_config=None, reuse: bool = False, dataset=None, **overrides
) -> SAEPPOTrainer:
    """With ``reuse`` False (for the bitwise comparisons) the rollout's value pass does not replay ``generate``'s
    unadapted layers, which agree with a full pass only to rounding."""
    torch.manual_seed(0)
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, num_layers=LAYERS, seed=0),
        reward_funcs=vowel_fraction,
        args=make_config(tmp_path, learning_rate=1e-2, critic_learning_rate=1e-2, **overrides),
        train_dataset=dataset if dataset is not None else make_dataset(),
        processing_class=tokenizer,
        peft_config=peft_config or last_layers_lora(),
    )
    critic = trainer.accelerator.unwrap_model(trainer.model)
    assert isinstance(critic, SharedBaseCritic)
    critic.share_prefix = share
    critic.reuse_generation_prefix = reuse
    return trainer


@torch.no_grad()
def perturbed(critic: SharedBaseCritic) -> SharedBaseCritic:
    """``critic`` with its adapters and value head moved off their zero initialisation, so they matter."""
    for parameter in critic.actor_parameters() + critic.critic_parameters():
        parameter.add_(0.05 * torch.randn_like(parameter))
    return critic


def count_calls(module: torch.nn.Module) -> list[int]:
    """A one-element list counting ``module``'s forward calls from now on."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    module.register_forward_hook(hook)
    return calls


def decoder_layers(critic: SharedBaseCritic) -> torch.nn.ModuleList:
    return critic.policy.get_base_model().model.layers


def sequences(batch: int = 3, prompt: int = 5, completion: int = 6) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 30, (batch, prompt + completion), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # a left-padded prompt
    attention_mask[1, -2:] = 0  # a short completion
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
    return input_ids, attention_mask, position_ids


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (dict(), 2),
        (dict(layers_to_transform=None), 0),  # every layer adapted
        (dict(modules_to_save=["embed_tokens"]), 0),  # the embeddings are the policy adapter's own
        (dict(modules_to_save=["lm_head"]), 2),  # after the layers: shares
    ],
)
def test_unadapted_prefix_layers_stop_at_the_first_adapted_layer_of_any_adapter(tokenizer, config, expected):
    from peft import get_peft_model

    policy = get_peft_model(
        build_tiny_qwen3(tokenizer, num_layers=LAYERS, seed=0), last_layers_lora(**config)
    )
    assert unadapted_prefix_layers(policy) == expected
    if expected == 2:  # every adapter counts: a reference adapter on layer 1 leaves one shared layer
        policy.add_adapter("reference", last_layers_lora(count=3))
        assert unadapted_prefix_layers(policy) == 1


def test_joint_forward_computes_the_unadapted_layers_once_with_identical_outputs_and_gradients(
    tokenizer, tmp_path
):
    trainer = make_trainer(tmp_path, tokenizer, share=True)
    critic = perturbed(trainer.accelerator.unwrap_model(trainer.model))
    with critic.shared_prefix():  # builds the sharing (its one-off check runs two passes of its own)
        pass
    layers = decoder_layers(critic)
    first, adapted = count_calls(layers[0].mlp), count_calls(layers[2].mlp)
    inputs = sequences()
    critic.train()

    def run(share: bool):
        critic.share_prefix = share
        critic.zero_grad(set_to_none=True)
        (logprobs, entropies), values = critic(*inputs, num_completion_tokens=6)
        (logprobs.sum() + entropies.sum() + values.square().sum()).backward()
        grads = [p.grad.clone() for p in critic.actor_parameters() + critic.critic_parameters()]
        return logprobs.detach(), values.detach(), grads

    full = run(False)
    assert first[0] == 2 and adapted[0] == 2  # the policy's and the critic's pass
    shared = run(True)
    assert first[0] == 3, "the unadapted layer ran again in the critic's pass"
    assert adapted[0] == 4  # the adapted layers run in both passes
    assert torch.equal(full[0], shared[0]) and torch.equal(full[1], shared[1])
    assert all(torch.equal(a, b) for a, b in zip(full[2], shared[2]))
    assert all(grad.abs().sum() > 0 for grad in shared[2][:1] + shared[2][-2:])
    assert not any(
        hook for layer in layers for hook in layer._forward_hooks.values() if "record" in repr(hook)
    )
    assert all("forward" not in layer.__dict__ for layer in layers), "a replayed layer kept its stand-in"


def test_passes_on_other_inputs_or_outside_the_scope_compute_in_full(tokenizer, tmp_path):
    trainer = make_trainer(tmp_path, tokenizer, share=True)
    critic = perturbed(trainer.accelerator.unwrap_model(trainer.model))
    with critic.shared_prefix():
        pass
    first = count_calls(decoder_layers(critic)[0].mlp)
    input_ids, attention_mask, position_ids = sequences()
    other = input_ids.clone()
    other[2, -3] += 1  # a completion token whose successors the values read
    with torch.no_grad():
        with critic.shared_prefix():
            values = critic.critic_values(input_ids, attention_mask, position_ids, 6)
            assert first[0] == 1
            critic.critic_values(input_ids.clone(), attention_mask, position_ids, 6)  # equal: replayed
            assert first[0] == 1
            changed = critic.critic_values(other, attention_mask, position_ids, 6)  # recorded anew
            assert first[0] == 2
            critic.critic_values(
                input_ids, attention_mask, position_ids, 6
            )  # one kept: the first was dropped
            assert first[0] == 3
        again = critic.critic_values(input_ids, attention_mask, position_ids, 6)
        assert first[0] == 4
        with critic.shared_prefix(max_recorded=2):  # e.g. the rollout's chunks
            for ids in (input_ids, other, input_ids, other):
                critic.critic_values(ids, attention_mask, position_ids, 6)
        assert first[0] == 6
        one_recording = 3 * 11 * critic.config.hidden_size * 4  # float32 (3, 11, H)
        with critic.shared_prefix(
            max_recorded=2, max_bytes=one_recording
        ):  # room for one: like max_recorded=1
            for ids in (input_ids, other, input_ids):
                critic.critic_values(ids, attention_mask, position_ids, 6)
        assert first[0] == 9
        with critic.shared_prefix(max_bytes=one_recording - 1):  # no room: every pass computes in full
            for ids in (input_ids, input_ids):
                critic.critic_values(ids, attention_mask, position_ids, 6)
        assert first[0] == 11
    assert torch.equal(values, again)
    assert not torch.equal(changed[2], values[2])


def test_a_model_whose_layers_read_an_earlier_layer_gets_no_sharing(tokenizer):
    from peft import get_peft_model

    policy = get_peft_model(build_tiny_qwen3(tokenizer, num_layers=LAYERS, seed=0), last_layers_lora())
    assert PrefixSharing.of(policy) is not None
    # A skip connection from layer 0 into layer 3 (as value-residual architectures have): a replayed layer 0
    # would hand layer 3 the wrong tensor, which the check at construction sees.
    layers = policy.get_base_model().model.layers
    stash = {}
    layers[0].register_forward_hook(lambda module, args, output: stash.update(first=output))
    layers[3].register_forward_hook(lambda module, args, output: output + stash["first"])
    assert PrefixSharing.of(policy) is None


@pytest.mark.parametrize(
    ("overrides", "value_phase_calls"),
    [
        # the value pass records the unadapted layers, the reference pass replays them
        (dict(kl_coef=0.05), {False: 2, True: 1}),
        # mixed precision: the rollout's teacher-forced recompute records, the value pass replays
        (dict(bf16=True), {False: 1, True: 0}),
        # gradient checkpointing: the rollout's passes (no grad) share, the update's keep their own layers
        (dict(bf16=True, gradient_checkpointing=True), {False: 1, True: 0}),
        # the rounds are re-padded into one batch: the value pass computes its own prefix
        (dict(filter_groups=True, max_num_gen_batches=2), {False: 1, True: 1}),
    ],
    ids=["kl", "bf16-recompute", "checkpointing", "filter-groups"],
)
def test_training_with_shared_prefix_gives_the_same_parameters(
    tmp_path, tokenizer, overrides, value_phase_calls
):
    trained, computed = {}, {}
    for share in (False, True):
        trainer = make_trainer(tmp_path / str(share), tokenizer, share=share, max_steps=2, **overrides)
        critic = trainer.accelerator.unwrap_model(trainer.model)
        calls = count_calls(decoder_layers(critic)[0].mlp)
        in_value_phase = []
        compute_values = trainer._compute_values

        def spy(batch, compute_values=compute_values, calls=calls, in_value_phase=in_value_phase):
            before = calls[0]
            compute_values(batch)
            in_value_phase.append(calls[0] - before)

        trainer._compute_values = spy
        trainer.train()
        trained[share] = {name: p.detach().clone() for name, p in critic.named_parameters()}
        computed[share] = calls[0]
        assert in_value_phase == [value_phase_calls[share]] * 2  # one rollout chunk a step
    assert trained[True].keys() == trained[False].keys()
    assert any("lora_B" in name for name in trained[True])
    for name, value in trained[True].items():
        assert torch.equal(value, trained[False][name]), name
    if not overrides.get("gradient_checkpointing"):  # there the one-off check's passes equal the saving
        assert computed[True] < computed[False]  # the update's critic passes replay the policy's


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED"])
def test_fsdp_and_deepspeed_keep_every_layer_in_every_pass(tmp_path, tokenizer, monkeypatch, kind):
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    trainer = make_trainer(tmp_path, tokenizer, share=True)
    monkeypatch.setattr(
        Accelerator, "distributed_type", property(lambda self: getattr(DistributedType, kind))
    )
    trainer._setup_prefix_sharing()  # what __init__ runs after accelerator.prepare
    assert trainer.accelerator.unwrap_model(trainer.model).share_prefix is False


DDP_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    torch.set_num_threads(1)
    from datasets import Dataset
    from peft import LoraConfig
    from trl_sae import SAEPPOConfig, SAEPPOTrainer
    from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3

    rank = int(os.environ["RANK"])

    def rank_reward(prompts, completions, completion_ids, **columns):
        # different rewards per rank: each rank's critic and policy gradients differ before DDP averages them
        return [text.count("a") / 6 + rank for text in completions]

    tokenizer = build_char_tokenizer()
    dataset = Dataset.from_dict({"prompt": [f"Prompt {i}:" for i in range(16)]})
    result = {}
    for share in (False, True):
        torch.manual_seed(0)
        config = SAEPPOConfig(
            output_dir=os.path.join(sys.argv[1], str(share)), per_device_train_batch_size=4, num_generations=2,
            response_length=6, max_steps=2, learning_rate=1e-2, critic_learning_rate=1e-2, report_to="none",
            disable_tqdm=True, save_strategy="no", use_cpu=True, seed=0, stop_token=None, kl_coef=0.05,
        )
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[2, 3])
        trainer = SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer, num_layers=4, seed=0), reward_funcs=rank_reward, args=config,
            train_dataset=dataset, processing_class=tokenizer, peft_config=lora,
        )
        wrapper = trainer.accelerator.unwrap_model(trainer.model)
        wrapper.share_prefix = share
        wrapper.reuse_generation_prefix = False  # rounds unlike the full pass: not bitwise
        trainer.train()
        result[str(share)] = {
            "parameters": [p.detach().double().sum().item() for p in wrapper.parameters() if p.requires_grad],
            "shared": wrapper._prefix_sharing is not None and wrapper._prefix_sharing[1] is not None,
            "world": trainer.accelerator.num_processes,
        }
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    """
)


@in_the_ddp_launch("shared_prefix")
def test_ddp_two_ranks_train_the_same_with_and_without_sharing(ddp_launch):
    ranks = [json.loads((ddp_launch / "shared_prefix" / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank in ranks:
        assert rank["True"]["world"] == 2 and rank["True"]["shared"]
        assert rank["True"]["parameters"] == rank["False"]["parameters"]  # bitwise: the same sums
    assert ranks[0]["True"]["parameters"] == ranks[1]["True"]["parameters"]  # DDP kept the replicas equal


# ------------------------------------------------------------------------------------------------------
# The rollout's value pass replays the unadapted layers generate computed (reuse_generation_prefix)
# ------------------------------------------------------------------------------------------------------


def ragged_prompts():
    """Prompts of 16 different lengths: a step's two prompts are always left-padded to the longer one."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [f"Hi{'!' * i}" for i in range(16)]})


def early_stopping(trainer: SAEPPOTrainer) -> SAEPPOTrainer:
    """Every digit, letter and most punctuation end a completion: rows stop after 1 to a few tokens, unevenly."""
    trainer.rollouts.generation_config.eos_token_id = list(range(3, 40))
    return trainer


def value_pass_calls(trainer: SAEPPOTrainer, layers: list[int]) -> tuple[list[int], ...]:
    """Counters of the given decoder layers' MLP calls, counted during ``_compute_values`` only."""
    critic = trainer.accelerator.unwrap_model(trainer.model)
    counters = [count_calls(decoder_layers(critic)[index].mlp) for index in layers]
    totals = [[0] for _ in layers]
    compute_values = trainer._compute_values

    def spy(batch):
        before = [counter[0] for counter in counters]
        compute_values(batch)
        for total, counter, start in zip(totals, counters, before):
            total[0] += counter[0] - start

    trainer._compute_values = spy
    return tuple(totals)


def test_rollout_values_replay_generate_s_unadapted_layers_to_float32_rounding(tmp_path, tokenizer):
    trainer = early_stopping(
        make_trainer(
            tmp_path, tokenizer, share=True, reuse=True, dataset=ragged_prompts(),
            response_length=12, local_rollout_forward_batch_size=3,  # 3 chunks of the 8 rows
        )
    )  # fmt: skip
    critic = perturbed(trainer.accelerator.unwrap_model(trainer.model))
    unadapted, adapted = value_pass_calls(trainer, [1, 2])  # layers 0-1 unadapted, 2-3 adapted
    with trainer._shared_prefix():  # as train_step: around the rollout and the value pass
        batch, _ = trainer.rollouts.collect(0)
        with trainer._shared_prefix():
            trainer._compute_values(batch)
    assert unadapted[0] == 0, "the value pass recomputed layers generate had computed"
    assert adapted[0] == 3  # one pass of the adapted layers per chunk
    lengths = batch.completion_mask.sum(1)
    assert lengths.unique().numel() >= 3 and lengths.min() < batch.completion_ids.shape[1] - 1  # early EOS
    assert batch.prompt_mask.sum(1).unique().numel() == 2  # left-padded prompts
    reused = batch.values
    critic.reuse_generation_prefix = False
    batch.values = None  # computed anew, not the captured ones kept
    with trainer._shared_prefix():
        trainer._compute_values(batch)
    assert unadapted[0] == 3  # now the value pass computes them, one chunk at a time
    full = batch.values
    assert full[batch.mask].abs().min() > 1e-3  # values that could be wrong
    torch.testing.assert_close(reused, full, rtol=0, atol=1e-5)
    assert torch.equal(reused == 0, full == 0)  # zero exactly where masked


def generate_recorded(policy, sharing, prompt_ids, prompt_mask, eos: list[int], tokens: int = 5):
    from transformers import GenerationConfig

    from trl_sae.generation.capture import generate_with_logprobs

    config = GenerationConfig(
        do_sample=True, top_k=0, max_new_tokens=tokens, eos_token_id=eos, pad_token_id=0
    )
    torch.manual_seed(3)  # every call samples the same tokens (until an EOS)
    with sharing.generation() as states:
        out = generate_with_logprobs(policy, prompt_ids, prompt_mask, config)
    return out, states


@torch.no_grad()
def test_generation_states_seed_the_full_pass_only_for_the_rows_generate_fed(tokenizer):
    from peft import get_peft_model

    from trl_sae.generation.inputs import left_pad, sequence_inputs

    policy = get_peft_model(build_tiny_qwen3(tokenizer, num_layers=LAYERS, seed=0), last_layers_lora())
    for parameter in adapter_parameters(policy):  # off LoRA's zero start, so the adapted layers differ
        parameter.add_(0.05 * torch.randn_like(parameter))
    policy.eval()
    sharing = PrefixSharing.of(policy)
    backbone = policy.get_base_model().model
    prompt_ids, prompt_mask = left_pad([[5, 6, 7, 8, 9], [10, 11, 12]], pad_id=0)
    out, _ = generate_recorded(policy, sharing, prompt_ids, prompt_mask, eos=[])
    row0, row1 = out.completion_ids.tolist()
    stop, token = next(  # a token that ends row 0 early and row 1 at least two tokens later
        (k, t) for k, t in enumerate(row0) if k >= 1 and t not in row0[:k] and t not in row1[: k + 2]
    )
    eos = [token]
    first_unadapted = count_calls(backbone.layers[0].mlp)

    def inputs_of(out, width: int | None = None) -> dict[str, torch.Tensor]:
        ids, mask = out.completion_ids, out.completion_mask
        if width is not None:  # another chunk's rows were longer: the batch is wider than this generate
            ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=0)
            mask = torch.nn.functional.pad(mask, (0, width - mask.shape[1]), value=0)
        return sequence_inputs(prompt_ids, prompt_mask, ids, mask)

    with sharing.scope(max_recorded=8):
        out, states = generate_recorded(policy, sharing, prompt_ids, prompt_mask, eos)
        lengths = out.completion_mask.sum(1).tolist()
        assert lengths[0] == stop + 1 and lengths[1] > stop + 2, lengths  # an early EOS, the chunk went on
        width = out.completion_ids.shape[1] + 2
        inputs = inputs_of(out, width)
        assert states.seed(inputs)
        seeded = sharing._recorded[-1][1]
        assert seeded.shape == (2, prompt_ids.shape[1] + width, backbone.config.hidden_size)
        assert torch.isfinite(seeded).all() and (seeded[:, -3:] == 0).all()  # never fed: zeros, not junk
        calls = first_unadapted[0]
        replayed = backbone(**inputs, use_cache=False).last_hidden_state
        assert first_unadapted[0] == calls  # replayed, not computed
        after_eos = inputs_of(out, width)
        after_eos["input_ids"][0, prompt_ids.shape[1] + stop + 1 :] = 7  # row 0 after its EOS: anything
        _, states = generate_recorded(policy, sharing, prompt_ids, prompt_mask, eos)
        assert states.seed(after_eos)
        changed = inputs_of(out, width)
        changed["input_ids"][1, prompt_ids.shape[1] + 1] += 1  # a token a value of row 1 reads
        _, states = generate_recorded(policy, sharing, prompt_ids, prompt_mask, eos)
        assert not states.seed(changed) and not states.calls  # nothing kept
        _, states = generate_recorded(policy, sharing, prompt_ids[:, 1:], prompt_mask[:, 1:], eos)
        assert not states.seed(inputs)  # another prompt width (another chunk's rows)
        _, states = generate_recorded(policy, sharing, prompt_ids, prompt_mask, eos, tokens=2)
        assert not states.seed(inputs)  # the same rows, but row 1 reads positions this generate never fed
    full = backbone(**inputs, use_cache=False).last_hidden_state
    positions = torch.arange(inputs["input_ids"].shape[1])
    # a row of L tokens has values at P - 1 .. P + L - 2 (before each of its tokens); the prompt's too
    read = (positions < prompt_ids.shape[1] + torch.tensor(lengths)[:, None] - 1) & inputs[
        "attention_mask"
    ].bool()
    torch.testing.assert_close(replayed[read], full[read], rtol=0, atol=1e-5)
    with sharing.generation() as states:  # outside a scope: nothing recorded for later passes
        pass
    assert not sharing.seed(inputs, seeded)


def test_training_with_generate_reuse_stays_within_rounding_of_reuse_off(tmp_path, tokenizer):
    trained, logs, calls = {}, {}, {}
    for reuse in (False, True):
        trainer = early_stopping(
            make_trainer(
                tmp_path / str(reuse), tokenizer, share=True, reuse=reuse, dataset=ragged_prompts(),
                max_steps=2, kl_coef=0.05, local_rollout_forward_batch_size=4,
            )
        )  # fmt: skip
        (calls[reuse],) = value_pass_calls(trainer, [0])
        trainer.train()
        critic = trainer.accelerator.unwrap_model(trainer.model)
        trained[reuse] = {
            name: p.detach().clone() for name, p in critic.named_parameters() if p.requires_grad
        }
        logs[reuse] = [entry for entry in trainer.state.log_history if "loss/policy" in entry]
    # the value pass records, the reference pass replays (2 chunks, 2 steps); with reuse both replay generate's
    assert calls == {False: [4], True: [0]}
    for name, value in trained[True].items():
        torch.testing.assert_close(value, trained[False][name], rtol=0, atol=1e-5, msg=name)
    assert len(logs[True]) == len(logs[False]) == 2
    for on, off in zip(logs[True], logs[False]):
        assert on["reward/mean"] == off["reward/mean"]  # the same completions
        for key in ("loss/policy", "loss/value", "values/mean", "advantages/std"):
            assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
