"""The running-sum task, its verifiable reward, the SFT warm start and held-out evaluation."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from trl_sae.demo.tasks import (
    DEMO_DEFAULTS,
    TASK_VARIANTS,
    extract_answer,
    format_prompt,
    format_solution,
    make_running_sum_dataset,
    make_running_sum_splits,
    running_sum_reward,
)
from trl_sae.demo.warmstart import _collate, sft_loss, sft_warm_start, tokenize_sft_examples
from trl_sae.evaluation import evaluate_accuracy, generate_completions


# --------------------------------------------------------------------------------------------------
# Task generation
# --------------------------------------------------------------------------------------------------
def test_format_solution_writes_each_step_and_the_answer():
    assert format_prompt([3, 5, 2, 7]) == "Add: 3 5 2 7"
    assert format_solution([3, 5, 2, 7]) == "3+5=8\n8+2=10\n10+7=17\nANSWER 17"
    # A sloppy teacher forgets the carry only on steps that carry, and keeps going from the wrong total.
    assert format_solution([3, 5, 2, 7], [True, True, True]) == "3+5=8\n8+2=0\n0+7=7\nANSWER 7"
    assert format_solution([3, 5, 2, 7], [False, False, True]) == "3+5=8\n8+2=10\n10+7=17\nANSWER 17"
    with pytest.raises(ValueError):
        format_solution([4])
    with pytest.raises(ValueError):
        format_solution([1, 2, 3], [True])


def test_dataset_is_deterministic_and_gold_answers_are_right():
    a = make_running_sum_dataset(50, seed=3)
    b = make_running_sum_dataset(50, seed=3)
    c = make_running_sum_dataset(50, seed=4)
    assert a.to_list() == b.to_list()
    assert a["terms"] != c["terms"]
    assert set(a.column_names) >= {"prompt", "answer", "solution", "terms"}
    lo, hi = TASK_VARIANTS["default"]["num_terms"]
    for row in a:
        terms = row["terms"]
        assert lo <= len(terms) <= hi
        assert all(1 <= x <= TASK_VARIANTS["default"]["max_value"] for x in terms)
        assert row["answer"] == str(sum(terms))
        assert row["prompt"] == [{"role": "user", "content": format_prompt(terms)}]
        assert extract_answer(row["solution"]) == sum(terms)
        assert row["solution_is_correct"]
        # The worked steps are real running sums.
        total = terms[0]
        for line, x in zip(row["solution"].splitlines(), terms[1:]):
            assert line == f"{total}+{x}={total + x}"
            total += x


def test_plain_prompts_long_variant_and_explicit_knobs():
    plain = make_running_sum_dataset(5, seed=0, chat=False)
    assert all(isinstance(p, str) and p.startswith("Add: ") for p in plain["prompt"])
    long = make_running_sum_dataset(40, seed=0, variant="long")
    short = make_running_sum_dataset(40, seed=0)
    lo, hi = TASK_VARIANTS["long"]["num_terms"]
    assert all(lo <= len(t) <= hi for t in long["terms"])
    mean = lambda texts: sum(map(len, texts)) / len(texts)  # noqa: E731
    assert mean(long["solution"]) > 2.5 * mean(short["solution"])
    custom = make_running_sum_dataset(10, num_terms=(2, 2), max_value=3, seed=0)
    assert all(len(t) == 2 and max(t) <= 3 for t in custom["terms"])
    with pytest.raises(ValueError):
        make_running_sum_dataset(3, variant="nope")
    with pytest.raises(ValueError):
        make_running_sum_dataset(3, num_terms=(1, 3))
    with pytest.raises(ValueError):
        # Only 3 distinct problems exist; excluding them all cannot succeed.
        make_running_sum_dataset(1, num_terms=(2, 2), max_value=1, exclude={(1, 1)})


def test_held_out_split_is_disjoint_from_train():
    splits = make_running_sum_splits(300, 100, seed=0)
    train = {tuple(t) for t in splits["train"]["terms"]}
    test = {tuple(t) for t in splits["test"]["terms"]}
    assert len(splits["test"]) == 100
    assert not train & test


def test_sloppy_teacher_only_changes_demonstrations_on_carrying_steps():
    clean = make_running_sum_dataset(300, seed=0)
    sloppy = make_running_sum_dataset(300, seed=0, teacher_error_rate=0.6)
    assert clean["terms"] == sloppy["terms"] and clean["answer"] == sloppy["answer"]
    wrong = 0
    for row in sloppy:
        terms = row["terms"]
        # The demonstration is one of the 2^(steps) "carry or forget" variants.
        variants = {
            format_solution(terms, f) for f in itertools.product([False, True], repeat=len(terms) - 1)
        }
        assert row["solution"] in variants
        assert row["solution_is_correct"] == (extract_answer(row["solution"]) == sum(terms))
        wrong += not row["solution_is_correct"]
    assert 0.3 < wrong / len(sloppy) < 0.9
    # The held-out split always has correct references.
    splits = make_running_sum_splits(100, 50, seed=0, teacher_error_rate=1.0)
    assert all(splits["test"]["solution_is_correct"])
    assert not all(splits["train"]["solution_is_correct"])


# --------------------------------------------------------------------------------------------------
# Reward
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("3+5=8\n8+2=10\n10+7=17\nANSWER 17", 1.0),  # correct
        ("ANSWER 17", 1.0),  # the reward checks the outcome only
        ("3+5=8\n8+2=10\n10+7=17\nANSWER 17\n\n  ", 1.0),  # trailing whitespace is fine
        ("3+5=8\n8+2=10\n10+7=16\nANSWER 16", 0.0),  # wrong
        ("3+5=8\n8+2=10\n10+7=17", 0.0),  # no answer line
        ("3+5=8\nANSWER 17\n8+2=10", 0.0),  # answer line not last
        ("ANSWER 16\nANSWER 17", 1.0),  # the last answer line counts
        ("ANSWER 17\nANSWER 16", 0.0),
        ("ANSWER: 17", 0.0),  # malformed
        ("ANSWER 17.0", 0.0),
        ("ANSWER 17 apples", 0.0),
        ("answer 17", 0.0),
        ("ANSWER", 0.0),
        ("", 0.0),
    ],
)
def test_running_sum_reward_cases(completion, reward):
    assert running_sum_reward(prompts=["p"], completions=[completion], answer=["17"]) == [reward]


def test_reward_accepts_chat_completions_int_answers_and_extra_columns():
    chat = [[{"role": "assistant", "content": "ANSWER 9"}], [{"role": "assistant", "content": "ANSWER 8"}]]
    assert running_sum_reward(
        prompts=["a", "b"], completions=chat, completion_ids=[[1], [2]], answer=[9, "9"], terms=[[4, 5]] * 2
    ) == [1.0, 0.0]
    assert extract_answer("ANSWER -3") == -3
    with pytest.raises(ValueError):
        running_sum_reward(completions=["ANSWER 1"], answer=["1", "2"])
    with pytest.raises(ValueError):
        running_sum_reward(completions=["ANSWER 1"])


# --------------------------------------------------------------------------------------------------
# SFT warm start
# --------------------------------------------------------------------------------------------------
def test_tokenized_sft_examples_mask_the_prompt_and_end_with_eos(tokenizer):
    data = make_running_sum_dataset(2, seed=0)
    (ids, labels), _ = tokenize_sft_examples(tokenizer, list(data["prompt"]), list(data["solution"]))
    completion = [t for t in labels if t != -100]
    assert completion[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(completion[:-1]) == data[0]["solution"]
    assert ids[-len(completion) :] == completion
    assert tokenizer.decode(ids[: len(ids) - len(completion)]).endswith("assistant\n")


def test_sft_warm_start_lowers_the_loss_and_is_deterministic(tokenizer):
    from trl_sae.demo.tiny import build_tiny_qwen3

    data = make_running_sum_dataset(64, seed=0)
    batch = _collate(tokenize_sft_examples(tokenizer, list(data["prompt"]), list(data["solution"])), 0)

    def trained() -> tuple[float, float, nn.Module]:
        model = build_tiny_qwen3(tokenizer, seed=0)
        with torch.no_grad():
            before = float(sft_loss(model, *batch))
        losses: list[float] = []
        sft_warm_start(
            model,
            tokenizer,
            data,
            max_steps=15,
            learning_rate=3e-3,
            batch_size=16,
            seed=0,
            warmup_steps=2,
            progress=False,
            callback=lambda step, loss: losses.append(loss),
        )
        assert len(losses) == 15 and not model.training
        with torch.no_grad():
            after = float(sft_loss(model, *batch))
        return before, after, model

    before, after, model_a = trained()
    assert after < 0.8 * before
    _, after_b, model_b = trained()
    assert after_b == after
    for p, q in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(p, q)


def test_sft_warm_start_validates_inputs(tiny_model, tokenizer):
    data = make_running_sum_dataset(4, seed=0)
    with pytest.raises(ValueError):
        sft_warm_start(tiny_model, tokenizer, data.remove_columns("solution"), max_steps=1, progress=False)
    with pytest.raises(ValueError):
        sft_warm_start(tiny_model, tokenizer, data, max_steps=-1, progress=False)
    assert sft_warm_start(tiny_model, tokenizer, data, max_steps=0) is tiny_model


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------
class ScriptedModel(nn.Module):
    """A stand-in causal LM whose ``generate`` writes a scripted answer for each row.

    It decodes each (left-padded) prompt, reads the terms, and writes the worked solution, with the
    final answer off by one on rows ``policy(row_index, terms)`` rejects. Then pads ragged rows the way
    ``generate`` does, so evaluation's padding and EOS handling are exercised for real.
    """

    def __init__(self, tokenizer, policy):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.tokenizer = tokenizer
        self.policy = policy
        self.calls: list[dict] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, eos_token_id, **kwargs):
        self.calls.append({"batch": input_ids.shape[0], **kwargs})
        rows = []
        for row, (ids, mask) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
            assert mask[-1] == 1  # left padding: the prompt ends in the last column
            prompt = self.tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
            terms = [int(x) for x in prompt.split("Add:")[1].split("\n")[0].split()]
            text = format_solution(terms)
            if not self.policy(row, terms):
                text = text.rsplit(" ", 1)[0] + f" {sum(terms) + 1}"
            new = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_token_id]
            rows.append(ids + new[:max_new_tokens])
        width = max(map(len, rows))
        return torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])


def test_evaluate_accuracy_greedy_counts_correct_answers(tokenizer):
    data = make_running_sum_dataset(30, seed=5)
    model = ScriptedModel(tokenizer, policy=lambda row, terms: terms[0] % 2 == 1)
    expected = sum(t[0] % 2 == 1 for t in data["terms"]) / len(data)
    assert 0 < expected < 1
    result = evaluate_accuracy(
        model, tokenizer, data, running_sum_reward, num_samples=3, batch_size=8, return_samples=True
    )
    assert result["accuracy"] == pytest.approx(expected)
    assert result["pass_at_k"] == pytest.approx(expected)  # greedy: all k samples are the same
    assert result["num_prompts"] == 30 and result["num_samples"] == 3
    assert result["truncated_fraction"] == 0.0
    assert all(call["do_sample"] is False for call in model.calls)
    assert sum(call["batch"] for call in model.calls) == 30  # greedy generates once per prompt
    sample = result["samples"][0]
    assert sample["completion"].startswith(f"{data[0]['terms'][0]}+")
    assert sample["reward"] == float(data[0]["terms"][0] % 2 == 1)


def test_evaluate_accuracy_sampling_avg_and_pass_at_k(tokenizer):
    data = make_running_sum_dataset(10, seed=1, chat=False)
    # Rows are prompt-major, so with a batch size divisible by k the row index mod k is the sample index:
    # exactly one of the 4 samples of each prompt is right.
    model = ScriptedModel(tokenizer, policy=lambda row, terms: row % 4 == 0)
    result = evaluate_accuracy(
        model, tokenizer, data, running_sum_reward, num_samples=4, temperature=1.0, batch_size=8
    )
    assert result["accuracy"] == pytest.approx(0.25)
    assert result["pass_at_k"] == pytest.approx(1.0)
    assert all(call["do_sample"] and call["top_k"] == 0 for call in model.calls)


def test_sampled_evaluation_is_seeded_and_leaves_the_callers_rng_alone(tiny_model, tokenizer):
    data = make_running_sum_dataset(4, seed=0)

    def run(seed):
        return evaluate_accuracy(
            tiny_model,
            tokenizer,
            data,
            running_sum_reward,
            num_samples=2,
            temperature=1.0,
            max_new_tokens=6,
            seed=seed,
            return_samples=True,
        )["samples"]

    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = run(0)
    assert torch.equal(torch.get_rng_state(), state)
    assert run(0) == first
    assert run(1) != first


def test_generate_completions_truncation_and_real_tiny_model(tiny_model, tokenizer):
    data = make_running_sum_dataset(6, seed=0)
    # A random tiny model: nothing is right, and every completion respects the token budget.
    result = evaluate_accuracy(
        tiny_model, tokenizer, data, running_sum_reward, max_new_tokens=5, batch_size=4
    )
    assert result["accuracy"] == 0.0 and result["mean_completion_tokens"] <= 5
    texts, ids = generate_completions(tiny_model, tokenizer, list(data["prompt"]), 5, batch_size=4)
    assert len(texts) == len(ids) == 6
    # Left padding does not change greedy outputs: one prompt alone gives the same completion.
    alone, _ = generate_completions(tiny_model, tokenizer, [data[3]["prompt"]], 5)
    assert alone[0] == texts[3]
    scripted = ScriptedModel(tokenizer, policy=lambda row, terms: True)
    cut = evaluate_accuracy(scripted, tokenizer, data, running_sum_reward, max_new_tokens=4)
    assert cut["truncated_fraction"] == 1.0 and cut["accuracy"] == 0.0


def test_demo_defaults_are_consistent():
    defaults = DEMO_DEFAULTS.to_dict()
    preset = TASK_VARIANTS[DEMO_DEFAULTS.variant]
    assert tuple(defaults["num_terms"]) == tuple(preset["num_terms"])
    assert defaults["max_value"] == preset["max_value"]
    assert 0.0 <= defaults["teacher_error_rate"] <= 1.0


def test_prepare_demo_wires_the_recipe_together():
    import dataclasses

    from trl_sae.demo.warmstart import prepare_demo

    small = dataclasses.replace(DEMO_DEFAULTS, n_train=40, n_test=8, sft_max_steps=3, sft_batch_size=4)
    setup = prepare_demo(small, progress=False)
    assert len(setup.train_dataset) == 40 and len(setup.test_dataset) == 8
    assert len(setup.sft_losses) == 3 and setup.sft_seconds > 0
    assert setup.model.config.num_hidden_layers == DEMO_DEFAULTS.num_layers
    assert all(setup.test_dataset["solution_is_correct"])
    assert not all(setup.train_dataset["solution_is_correct"])  # the sloppy teacher
