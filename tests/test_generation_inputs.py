"""Tests of trl_sae.generation.inputs, the one place prompts are encoded, padded and stopped: the trainer,
the evaluation and the analysis agree on prompt tokens and stop at every EOS of the model."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tokenizers import processors

from trl_sae import SAEPPOConfig, SAEPPOTrainer
from trl_sae.analysis import (
    correlate_advantages,
    monte_carlo_values,
    sampling_generation_config,
    segment_stats_vs_threshold,
)
from trl_sae.demo.tiny import build_char_tokenizer, build_tiny_qwen3
from trl_sae.evaluation import evaluate_accuracy, generate_completions
from trl_sae.generation.capture import pure_sampling_config
from trl_sae.generation.inputs import (
    encode_prompt,
    left_pad,
    model_stop_token_ids,
    peft_base_model,
    prompt_openings,
    right_pad,
    sequence_inputs,
    truncate_prompt,
)

PROMPT = "Same prompt:"


def peaked_qwen3(tokenizer) -> tuple[torch.nn.Module, int]:
    """A tiny Qwen3 whose logits are scaled x1000 (sampling is greedy in effect) and the id it emits first
    after ``PROMPT`` (never the tokenizer's EOS)."""
    model = build_tiny_qwen3(tokenizer, seed=0)
    with torch.no_grad():
        model.model.norm.weight.mul_(1000.0)
        logits = model(input_ids=torch.tensor([encode_prompt(tokenizer, PROMPT)])).logits[0, -1]
        logits[tokenizer.eos_token_id] = -float("inf")
    return model, int(logits.argmax())


def test_padding_and_sequence_inputs_by_hand():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    completions = right_pad([torch.tensor([3, 4]), torch.tensor([9])], 0)
    assert completions.tolist() == [[3, 4], [9, 0]]
    assert right_pad([[], []], -100).tolist() == [[-100], [-100]]  # at least one column
    inputs = sequence_inputs(ids, mask, completions, torch.tensor([[1, 1], [1, 0]]))
    assert inputs["input_ids"].tolist() == [[5, 6, 7, 3, 4], [0, 0, 8, 9, 0]]
    # Positions count valid tokens only: the left padding does not shift the second row.
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 1]]


def test_evaluation_stops_at_every_eos_the_model_declares(tokenizer):
    # Before: evaluation passed only the tokenizer's EOS to generate, so a model whose generation_config
    # lists a second EOS (Qwen3 instruct: <|im_end|> and <|endoftext|>) ran on to max_new_tokens.
    model, first = peaked_qwen3(tokenizer)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, first]
    assert model_stop_token_ids(model, tokenizer) == [tokenizer.eos_token_id, first]
    texts, ids = generate_completions(model, tokenizer, [PROMPT, PROMPT], max_new_tokens=8)
    assert ids == [[first], [first]]
    assert texts == [tokenizer.decode([first])] * 2

    def reward(prompts, completions, completion_ids, **columns):
        return [1.0] * len(completions)

    result = evaluate_accuracy(
        model, tokenizer, Dataset.from_dict({"prompt": [PROMPT]}), reward, max_new_tokens=8
    )
    assert result["mean_completion_tokens"] == 1.0
    assert result["truncated_fraction"] == 0.0


def test_evaluation_leaves_every_submodule_in_the_mode_it_found_it(tokenizer):
    # Before: generate_completions ended with model.train(), which put every submodule in train mode. A
    # from_pretrained base (eval mode) under peft adapters (train mode) then came out of an evaluation in
    # another state than it went in, so a run with a step-0 evaluation trained from another state.
    model = build_tiny_qwen3(tokenizer, seed=0).train()
    model.model.layers[0].eval()
    modes = {name: module.training for name, module in model.named_modules()}
    assert sum(not training for training in modes.values()) > 1

    def reward(prompts, completions, completion_ids, **columns):
        return [0.0] * len(completions)

    evaluate_accuracy(model, tokenizer, Dataset.from_dict({"prompt": [PROMPT]}), reward, max_new_tokens=2)
    assert {name: module.training for name, module in model.named_modules()} == modes


def test_analysis_stops_at_the_tokenizers_eos_too():
    # Before: the analysis used the model's generation_config EOS and ignored the tokenizer's, so a
    # checkpoint whose tokenizer ends turns with another token than its generation_config names
    # sampled past it (the trainer's rollouts stop at both).
    tokenizer = build_char_tokenizer()
    model, first = peaked_qwen3(tokenizer)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id]
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(first)
    assert tokenizer.eos_token_id == first
    seen: list[list[int]] = []

    def reward(prompts, completions, completion_ids, **columns):
        seen.extend(completion_ids)
        return [1.0] * len(completions)

    mc = monte_carlo_values(
        model,
        tokenizer,
        rows=[{"prompt": PROMPT}],
        prompt_ids=[encode_prompt(tokenizer, PROMPT)],
        prefix_ids=[[]],
        budgets=[8],
        reward_func=reward,
        num_continuations=3,
        show_progress=False,
    )
    assert seen == [[first]] * 3 and mc.values.tolist() == [1.0]
    (row,) = segment_stats_vs_threshold(
        model, tokenizer, [PROMPT], p_grid=(0.5,), num_samples=2, max_new_tokens=8, show_progress=False
    )
    assert row.mean_completion_length == 1.0


def test_analysis_encodes_text_prompts_as_the_trainer_does(tiny_model):
    # A tokenizer that prepends a special token that is not a BOS when asked for special tokens. The trainer
    # tokenises text prompts without it, as TRL does (only a BOS is added: the test below); before, the
    # analysis added it, so its critic and continuations saw one more prompt token than training did.
    tokenizer = build_char_tokenizer()
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A",
        special_tokens=[("<|im_start|>", tokenizer.convert_tokens_to_ids("<|im_start|>"))],
    )
    plain = tokenizer("Add: 1 2", add_special_tokens=False)["input_ids"]
    assert tokenizer("Add: 1 2")["input_ids"] == [tokenizer.convert_tokens_to_ids("<|im_start|>"), *plain]
    assert encode_prompt(tokenizer, "Add: 1 2") == plain
    prompts_seen: list[list[int]] = []

    def value_fn(sequences, attention_mask, prompt_length):
        for row, mask in zip(
            sequences[:, :prompt_length].tolist(), attention_mask[:, :prompt_length].tolist()
        ):
            prompts_seen.append([t for t, m in zip(row, mask) if m])
        return torch.zeros(sequences.shape[0], sequences.shape[1] - prompt_length)

    correlate_advantages(
        tiny_model,
        tokenizer,
        ["Add: 1 2"],
        reward_func=lambda prompts, completions, completion_ids, **kw: [1.0] * len(completions),
        value_fn=value_fn,
        num_trajectories=2,
        num_spans_per_trajectory=1,
        num_continuations=1,
        max_new_tokens=4,
        num_bootstrap=0,
        show_progress=False,
    )
    assert prompts_seen == [plain, plain]


def test_analysis_samples_with_the_trainers_generation_config(tmp_path, tokenizer):
    # Same model, same temperature and horizon: the analysis's sampling config is the trainer's rollout
    # config field for field (before, its EOS list lacked the tokenizer's EOS when the model named another).
    model, first = peaked_qwen3(tokenizer)
    model.generation_config.eos_token_id = [first]
    args = SAEPPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        response_length=8,
        temperature=0.7,
        max_steps=1,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        use_cpu=True,
        stop_token="eos",
    )
    trainer = SAEPPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 4}),
        processing_class=tokenizer,
    )
    analysis = sampling_generation_config(model, tokenizer, temperature=0.7, max_new_tokens=8)
    assert trainer.generation_config.eos_token_id == [first, tokenizer.eos_token_id]
    assert analysis.to_dict() == trainer.generation_config.to_dict()
    assert analysis.to_dict() == pure_sampling_config(0.7, 8, [first, tokenizer.eos_token_id], 0).to_dict()


def bos_char_tokenizer(chat_template_bos: bool = False):
    """The character tokenizer with a BOS ``<s>`` that it puts before plain text (Gemma- and Llama-style);
    ``chat_template_bos``: its chat template writes the BOS too, as those models' templates do."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)]
    )
    if chat_template_bos:
        tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    return tokenizer


def test_plain_text_prompts_get_the_bos_the_tokenizer_puts_before_text():
    tokenizer = bos_char_tokenizer()
    bos = tokenizer.bos_token_id
    plain = tokenizer("Add: 1 2", add_special_tokens=False)["input_ids"]
    assert tokenizer("Add: 1 2")["input_ids"] == [bos, *plain]
    assert encode_prompt(tokenizer, "Add: 1 2") == [bos, *plain]
    assert encode_prompt(tokenizer, "<s>Add: 1 2") == [bos, *plain]  # already there: never twice
    assert encode_prompt(tokenizer, "") == []  # an empty prompt stays empty: the dataset check refuses it
    # chat prompts are the template's tokens, BOS or not (transformers' apply_chat_template does the same)
    chat = [{"role": "user", "content": "Add: 1 2"}]
    for template_bos in (False, True):
        chat_tokenizer = bos_char_tokenizer(chat_template_bos=template_bos)
        ids = encode_prompt(chat_tokenizer, chat)
        assert (
            ids
            == chat_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)[
                "input_ids"
            ]
        )
        assert ids.count(bos) == int(template_bos) and (ids[0] == bos) == template_bos


def test_prompts_of_a_tokenizer_without_bos_are_the_texts_ids(tokenizer):
    # Qwen-style (the fixtures' tokenizer: no BOS, and a post-processor that adds nothing): ids unchanged
    assert tokenizer.bos_token_id is None
    for text in ("Say vowels 3:", "", "<|im_start|>x"):
        assert encode_prompt(tokenizer, text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    chat = [{"role": "user", "content": "Say vowels 3:"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert encode_prompt(tokenizer, chat) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_trainer_and_vllm_rollouts_read_the_prompts_with_their_bos(tmp_path):
    from tests.test_trainer import make_config, make_dataset
    from trl_sae.generation.vllm_backend import VLLMRollout

    tokenizer = bos_char_tokenizer()
    trainer = SAEPPOTrainer(
        model=build_tiny_qwen3(tokenizer, seed=0),
        reward_funcs=lambda completions, **kw: [0.0] * len(completions),
        args=make_config(tmp_path),
        train_dataset=make_dataset(4),
        processing_class=tokenizer,
    )
    rows = [trainer.train_dataset[i] for i in range(2)]
    expected = [
        [tokenizer.bos_token_id, *tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]] for r in rows
    ]
    assert [r["input_ids"] for r in rows] == expected
    prompts = trainer.rollouts.collate(rows)

    # The vLLM backend sends the engine the trainer's ids (as prompt_token_ids, which vLLM does not re-encode).
    class RecordingEngine:
        max_completion_length = 2

        def __init__(self):
            self.prompts: list[list[int]] = []

        def sample(self, prompts, num_generations, seeds):
            self.prompts.extend(prompts)
            return [[5, 6]] * (len(prompts) * num_generations), [[-1.0, -1.0]] * (
                len(prompts) * num_generations
            )

    rollout = object.__new__(VLLMRollout)
    rollout.tokenizer, rollout.stop_token_ids, rollout._engine = tokenizer, [], RecordingEngine()
    rollout.generate(prompts["prompt_ids"], prompts["prompt_mask"], trainer.args.num_generations, seed=0)
    assert rollout._engine.prompts == expected


# --------------------------------------------------------------------------------------------------
# overlong_prompts="truncate": the opening stays
# --------------------------------------------------------------------------------------------------
SYSTEM_OPENING = "<|im_start|>system\nBe terse.<|im_end|>\n"


def opening_tokenizer():
    """A BOS tokenizer whose chat template opens with the BOS and a default system message (as Qwen2.5's)."""
    tokenizer = bos_char_tokenizer()
    tokenizer.chat_template = "{{ bos_token }}" + SYSTEM_OPENING + tokenizer.chat_template
    return tokenizer


def test_truncated_prompts_keep_the_bos_and_the_chat_templates_opening(tmp_path):
    from tests.test_inputs import config, mixed_lengths

    tokenizer = opening_tokenizer()
    bos = tokenizer.bos_token_id
    head_text = "<s>" + SYSTEM_OPENING + "<|im_start|>user\n"
    head = tokenizer(head_text, add_special_tokens=False)["input_ids"]
    assert prompt_openings(tokenizer) == [[bos], head]
    dataset = mixed_lengths(3)
    with pytest.warns(UserWarning, match=r"3 of 16 prompts .* truncating them to 64 tokens: their opening"):
        trainer = SAEPPOTrainer(
            model=build_tiny_qwen3(tokenizer, seed=0),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=config(tmp_path, max_prompt_length=64, overlong_prompts="truncate"),
            train_dataset=dataset,
            processing_class=tokenizer,
        )
    full = encode_prompt(tokenizer, dataset[0]["prompt"])
    assert len(full) == 143 and len(head) == 26
    truncated = trainer.train_dataset[0]["input_ids"]
    assert truncated == head + full[-(64 - 26) :]
    text = tokenizer.decode(truncated)
    assert text.startswith(head_text) and text.endswith("long <|im_end|>\n<|im_start|>assistant\n")
    # prompts within the limit are untouched
    assert trainer.train_dataset[3]["input_ids"] == encode_prompt(tokenizer, dataset[3]["prompt"])


def test_truncate_prompt_keeps_only_the_opening_a_prompt_shares():
    tokenizer = opening_tokenizer()
    openings = prompt_openings(tokenizer)
    bos = tokenizer.bos_token_id
    text = encode_prompt(tokenizer, "x" * 30)
    assert truncate_prompt(text, 10, openings) == [bos, *text[-9:]]  # plain text: the BOS
    # a prompt with a system message of its own shares the opening up to that message's "<|im_start|>"
    own_system = [{"role": "system", "content": "Think."}, {"role": "user", "content": "y" * 30}]
    ids = encode_prompt(tokenizer, own_system)
    shared = tokenizer("<s>" + SYSTEM_OPENING + "<|im_start|>", add_special_tokens=False)["input_ids"]
    assert len(shared) == 21 and truncate_prompt(ids, 30, openings) == shared + ids[-9:]
    # the fixtures' tokenizer (no BOS, no default system): "<|im_start|>user\n", 6 tokens
    plain = build_char_tokenizer()
    chat = encode_prompt(plain, [{"role": "user", "content": "z" * 30}])
    assert truncate_prompt(chat, 12, prompt_openings(plain)) == chat[:6] + chat[-6:]
    assert truncate_prompt(chat, len(chat), prompt_openings(plain)) == chat
    with pytest.raises(
        ValueError, match=r"max_prompt_length=26 leaves no room after the prompt's opening \(26"
    ):
        truncate_prompt(encode_prompt(tokenizer, [{"role": "user", "content": "q" * 30}]), 26, openings)


def test_the_peft_base_is_the_adapted_transformers_model_for_generation_and_vllm(tokenizer):
    """One unwrap for the HF sampler and the vLLM engine: the model under the peft wrapper, adapters in."""
    from peft import LoraConfig, get_peft_model

    from trl_sae.generation.capture import _unwrap_model

    model = build_tiny_qwen3(tokenizer, seed=0)
    assert peft_base_model(model) is model
    peft = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    base = peft_base_model(peft)
    assert base is peft.base_model.model and type(base).__name__ == "Qwen3ForCausalLM"
    assert any("lora_A" in name for name, _ in base.named_parameters())
    wrapped = torch.nn.Module()
    wrapped.module = peft  # DistributedDataParallel-style
    assert _unwrap_model(wrapped) is base
