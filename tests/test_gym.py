"""reasoning-gym tasks as prompt datasets and rewards, GGUF path resolution and its one-line errors (fast: no
model is loaded here; tests/test_real_model.py trains the real one)."""

from __future__ import annotations

import datetime
import importlib.util
import json
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install 'trl-sae[gym]')")

from trl_sae.gguf import from_pretrained_dense, resolve_pretrained
from trl_sae.gym import ANSWER_INSTRUCTION, ENTRY_COLUMN, GENERATOR_KEY, load_reasoning_gym
from trl_sae.recipe import ScriptArguments, load_recipe_datasets, resolve_reward_funcs
from trl_sae.rewards.reasoning_gym import reasoning_gym_accuracy
from trl_sae.rewards.registry import REWARD_FUNCTIONS

SMALL_SUMS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}


def score(dataset, texts):
    """The reward of one chat completion per row of ``dataset``."""
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    return reasoning_gym_accuracy(
        list(dataset["prompt"]), completions, None, **{ENTRY_COLUMN: list(dataset[ENTRY_COLUMN])}
    )


def test_loader_gives_chat_prompts_with_the_answer_format_and_the_entry():
    dataset = load_reasoning_gym("chain_sum", 6, seed=3, config=SMALL_SUMS, system_prompt="Be brief.")
    assert len(dataset) == 6
    row = dataset[0]
    assert row["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert row["prompt"][1]["role"] == "user"
    assert row["prompt"][1]["content"].startswith(row["question"])
    assert row["prompt"][1]["content"].endswith(ANSWER_INSTRUCTION)
    entry = json.loads(row[ENTRY_COLUMN])
    assert entry["answer"] == row["answer"] and entry["metadata"]["source_dataset"] == "chain_sum"
    # the task's own settings reach the generator: 2 or 3 terms of at most 2 digits
    for question in dataset["question"]:
        numbers = [
            int(n)
            for n in question.split(":")[-1].replace("=", " ").replace("+", " ").replace("-", " ").split()
        ]
        assert 2 <= len(numbers) <= 3 and max(numbers) < 100
    # same seed, same problems; another seed, other problems
    assert load_reasoning_gym("chain_sum", 6, seed=3, config=SMALL_SUMS)["question"] == dataset["question"]
    assert load_reasoning_gym("chain_sum", 6, seed=4, config=SMALL_SUMS)["question"] != dataset["question"]
    plain = load_reasoning_gym("chain_sum", 2, seed=3, config=SMALL_SUMS, chat=False)
    assert plain["prompt"][0] == f"{plain['question'][0].rstrip()}\n\n{ANSWER_INSTRUCTION}"


def test_few_shot_examples_are_solved_earlier_turns_never_asked_again():
    dataset = load_reasoning_gym(
        "chain_sum", 30, seed=2, config={"max_terms": 2, "max_digits": 1}, few_shot=2
    )
    prompt = dataset[0]["prompt"]
    assert [m["role"] for m in prompt] == ["user", "assistant", "user", "assistant", "user"]
    for question, answer in zip(prompt[0:4:2], prompt[1:4:2]):
        assert question["content"].endswith(ANSWER_INSTRUCTION)
        # the task's own solution, then the tagged answer: that answer is right by the task's verifier
        expression, tagged = answer["content"].split("\n")
        value = expression.split(" = ")[-1]
        assert eval(expression.split(" = ")[0]) == int(value) and tagged == f"<answer>{value}</answer>"
    shots = {m["content"] for m in prompt[:4:2]}
    assert all(p[:4] == prompt[:4] for p in dataset["prompt"])  # the same examples for every row
    assert not shots & {p[-1]["content"] for p in dataset["prompt"]}
    with pytest.raises(ValueError, match="few_shot must be >= 0"):
        load_reasoning_gym("chain_sum", 2, few_shot=-1)


@settings(max_examples=60, deadline=None)
@given(
    numbers=st.lists(st.integers(0, 999), min_size=2, max_size=6),
    signs=st.lists(st.sampled_from("+-"), min_size=5, max_size=5),
)
def test_chain_steps_are_left_to_right_partial_results_ending_in_the_value(numbers, signs):
    from trl_sae.gym import chain_steps

    expression = " ".join([str(numbers[0]), *(f"{s} {n}" for s, n in zip(signs, numbers[1:]))])
    lines = chain_steps(expression)
    assert len(lines) == len(numbers) - 1
    for line, previous in zip(lines[1:], lines):  # each step starts from the previous step's result
        assert line.split(" ")[0] == previous.split(" = ")[1]
    for line in lines:
        left, result = line.split(" = ")
        assert eval(left) == int(result)
    assert int(lines[-1].split(" = ")[1]) == eval(expression)


def test_chain_steps_refuse_what_left_to_right_would_get_wrong():
    from trl_sae.gym import chain_steps

    assert chain_steps("2 + 3 * 4") is None and chain_steps("(2 + 3) - 4") is None
    assert chain_steps("7") is None and chain_steps("2.5 + 1") is None


def test_worked_steps_examples_show_one_operation_a_line():
    """Issue 31.3: the longer task's examples work a 4-5 term chain out step by step (several lines before the
    answer), so the completions that imitate them are longer than one line; the questions are unchanged."""
    config = {"min_terms": 4, "max_terms": 5, "min_digits": 2, "max_digits": 3, "operators": ["+", "-"]}
    config.update(allow_parentheses=False, allow_negation=False)  # a plain chain: left to right is right
    stepped = load_reasoning_gym("basic_arithmetic", 3, seed=1, config=config, few_shot=2, worked_steps=True)
    plain = load_reasoning_gym("basic_arithmetic", 3, seed=1, config=config, few_shot=2)
    assert stepped["question"] == plain["question"]
    for answer in (m["content"] for m in stepped[0]["prompt"][1:4:2]):
        *steps, tagged = answer.split("\n")
        assert len(steps) >= 3  # 4-5 terms: 3-4 operations
        assert tagged == f"<answer>{steps[-1].split(' = ')[1]}</answer>"
    assert all(len(m["content"].split("\n")) == 2 for m in plain[0]["prompt"][1:4:2])


def test_loader_excludes_questions_and_names_bad_settings():
    train = load_reasoning_gym(
        "chain_sum", 40, seed=0, config={"min_terms": 2, "max_terms": 2, "max_digits": 1}
    )
    held_out = load_reasoning_gym(
        "chain_sum",
        40,
        seed=1,
        config={"min_terms": 2, "max_terms": 2, "max_digits": 1},
        exclude_questions=set(train["question"]),
    )
    # 2 one-digit terms: ~200 problems, so 40 + 40 overlap unless excluded
    assert not set(held_out["question"]) & set(train["question"])
    assert 0 < len(held_out) < 40
    with pytest.raises(ValueError, match="reasoning-gym task 'no_such_task'"):
        load_reasoning_gym("no_such_task", 2)
    with pytest.raises(ValueError, match="reasoning-gym task 'chain_sum'"):
        load_reasoning_gym("chain_sum", 2, config={"min_terms": 3, "max_terms": 2})


def test_reward_scores_the_tagged_answer_with_the_tasks_verifier():
    dataset = load_reasoning_gym("chain_sum", 4, seed=5, config=SMALL_SUMS)
    answers = dataset["answer"]
    texts = [
        f"Adding up gives {answers[0]}. <answer>{answers[0]}</answer>",
        f"<answer>{int(answers[1]) + 1}</answer>",  # wrong number
        f"The answer is {answers[2]}.",  # right number, no tags: not an answer in the stated format
        f"<answer>0</answer> no, wait: <answer> {answers[3]} </answer>",  # the last tag counts
    ]
    assert score(dataset, texts) == [1.0, 0.0, 0.0, 1.0]
    assert REWARD_FUNCTIONS["reasoning_gym"] is reasoning_gym_accuracy
    assert resolve_reward_funcs(["reasoning_gym"]) == [reasoning_gym_accuracy]
    with pytest.raises(ValueError, match=ENTRY_COLUMN):
        reasoning_gym_accuracy(["p"], ["<answer>1</answer>"], None, answer=["1"])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), offset=st.integers(-50, 50).filter(lambda d: d != 0))
def test_reward_is_one_exactly_on_the_reference_answer(seed, offset):
    dataset = load_reasoning_gym("basic_arithmetic", 1, seed=seed, config={"max_terms": 3, "max_digits": 2})
    answer = dataset["answer"][0]
    assert score(dataset, [f"<answer>{answer}</answer>"]) == [1.0]
    wrong = f"{float(answer) + offset:g}"
    [got] = score(dataset, [f"<answer>{wrong}</answer>"])
    # reasoning-gym's default verifier gives partial credit, len(answer) / len(wrong), when the reference
    # is a substring of a wrong answer ("1" in "11"); only the exact answer scores 1 (counts as correct)
    assert got == (len(answer) / len(wrong) if answer in wrong else 0.0) and got < 1.0


def test_each_row_is_scored_with_the_settings_it_was_generated_with():
    # decimal_arithmetic's tolerance is 10 ** -max_num_decimal_places: 5 places generated, answers off by 5e-4
    # are wrong; the task's default settings (3 places) would accept them
    places = {"min_num_decimal_places": 5, "max_num_decimal_places": 5}
    dataset = load_reasoning_gym("decimal_arithmetic", 20, seed=0, config=places)
    off = [f"<answer>{Decimal(a) + Decimal('0.0005')}</answer>" for a in dataset["answer"]]
    assert score(dataset, off) == [0.0] * 20
    assert score(dataset, [f"<answer>{a}</answer>" for a in dataset["answer"]]) == [1.0] * 20
    import reasoning_gym

    generator = reasoning_gym.create_dataset("decimal_arithmetic", size=20, seed=0, **places)
    assert [generator.score_answer(t[8:-9], e) for t, e in zip(off, generator, strict=True)] == [0.0] * 20
    # puzzle24 accepts only numbers within [min_value, max_value]: 8 is outside 1..6 (the default is 1..10)
    puzzles = load_reasoning_gym("puzzle24", 2, seed=1, config={"min_value": 1, "max_value": 6})
    generator = reasoning_gym.create_dataset("puzzle24", size=2, seed=1, min_value=1, max_value=6)
    assert [generator.score_answer("8*3*1*1", e) for e in generator] == [0.01, 0.01]
    assert [reasoning_gym.get_score_answer_fn("puzzle24")("8*3*1*1", e) for e in generator] == [1.0, 1.0]
    assert score(puzzles, ["<answer>8*3*1*1</answer>"] * 2) == [0.01, 0.01]
    # time_intervals gives partial credit 1 - |error| / max_date_difference_days (10 here, 100 by default);
    # its date bounds travel with the rows too
    dates = {"task_types": ["date"], "max_date_difference_days": 10, "min_date": datetime.date(2000, 1, 1)}
    intervals = load_reasoning_gym("time_intervals", 3, seed=2, config=dates)
    late = [f"<answer>{int(a.split()[0]) + 5} days</answer>" for a in intervals["answer"]]
    assert score(intervals, late) == [0.5] * 3
    assert json.loads(intervals[0][ENTRY_COLUMN])[GENERATOR_KEY]["min_date"] == {
        "__isoformat__": "date",
        "value": "2000-01-01",
    }


def test_puzzle24_answers_must_make_exactly_24_from_the_puzzles_own_numbers():
    # reasoning-gym's verifier checks only that four numbers in range appear and that the value truncated to
    # an int is 24: "6*4*1*1" solved every puzzle and "6*4 + 1/2" (24.5) too
    puzzles = load_reasoning_gym("puzzle24", 3, seed=1)
    import reasoning_gym

    verifier = reasoning_gym.create_dataset("puzzle24", size=3, seed=1).score_answer
    entries = [json.loads(value) for value in puzzles[ENTRY_COLUMN]]
    assert [verifier(gamed, e) for e in entries for gamed in ("6*4*1*1", "6*4 + 1/2")] == [1.0] * 6
    assert score(puzzles, ["<answer>6*4*1*1</answer>"] * 3) == [0.01] * 3
    assert score(puzzles, ["<answer>6*4 + 1/2</answer>"] * 3) == [0.01] * 3
    assert score(puzzles, [f"<answer>{a}</answer>" for a in puzzles["answer"]]) == [1.0] * 3
    a, b, c, d = entries[0]["metadata"]["numbers"]  # 8, 5, 10, 6: 10*(8 - 5) - 6
    assert (a, b, c, d) == (8, 5, 10, 6)
    first = puzzles.select([0])
    assert score(first, ["<answer>(8 - 5) * 10 - 6</answer>"]) == [1.0]  # any order, spacing, parentheses
    assert score(first, ["<answer>(8 - 5) * 10 - 6 + 0</answer>"]) == [0.01]  # a fifth number
    assert score(first, ["<answer>(8 - 5) * 10 - 6.0</answer>"]) == [0.01]  # not the puzzle's integers
    assert score(first, ["<answer>-(6 - (8 - 5) * 10)</answer>"]) == [0.01]  # unary minus: not an operator
    assert score(first, ["<answer>10 * (8 - 5) - 6 =</answer>"]) == [0.01]  # not an expression
    assert score(first, ["10 * (8 - 5) - 6"]) == [0.01]  # no tags: a missing answer


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 100_000))
def test_every_puzzle24_reference_answer_still_scores_one(seed):
    puzzles = load_reasoning_gym("puzzle24", 5, seed=seed)
    assert score(puzzles, [f"<answer>{a}</answer>" for a in puzzles["answer"]]) == [1.0] * 5
    # one number swapped for another in range is never a solution of this puzzle
    swapped = []
    for answer, value in zip(puzzles["answer"], puzzles[ENTRY_COLUMN], strict=True):
        numbers = json.loads(value)["metadata"]["numbers"]
        other = next(n for n in range(1, 11) if n not in numbers)
        swapped.append(f"<answer>{answer.replace(str(numbers[0]), str(other), 1)}</answer>")
    assert all(got < 1.0 for got in score(puzzles, swapped))


def test_rows_without_their_settings_are_refused():
    dataset = load_reasoning_gym("chain_sum", 1, seed=5, config=SMALL_SUMS)
    entry = json.loads(dataset[0][ENTRY_COLUMN])
    del entry[GENERATOR_KEY]
    with pytest.raises(ValueError, match=GENERATOR_KEY):
        reasoning_gym_accuracy(["p"], ["<answer>1</answer>"], None, **{ENTRY_COLUMN: [json.dumps(entry)]})
    with pytest.raises(ValueError, match="cannot be stored with the rows"):
        load_reasoning_gym("chain_sum", 1, config={"min_terms": object()})


def test_recipe_loads_a_gym_task_with_a_disjoint_held_out_set():
    script_args = ScriptArguments(
        dataset_name="reasoning_gym:chain_sum",
        eval_dataset_name="reasoning_gym:chain_sum",
        max_train_samples=30,
        max_eval_samples=30,
        reasoning_gym_config=json.dumps({"min_terms": 2, "max_terms": 2, "max_digits": 1}),
    )
    train, held_out = load_recipe_datasets(script_args, seed=7)
    assert len(train) == 30 and 0 < len(held_out) <= 30
    assert not set(train["question"]) & set(held_out["question"])
    assert (
        train["question"]
        == load_reasoning_gym(
            "chain_sum", 30, seed=7, config={"min_terms": 2, "max_terms": 2, "max_digits": 1}
        )["question"]
    )
    for field, value, match in [
        ("max_train_samples", None, "max_train_samples: set how many"),
        ("dataset_split", "train", "dataset_split: a reasoning-gym task has no splits"),
        ("reasoning_gym_config", "[1]", "reasoning_gym_config: must be a JSON object"),
    ]:
        broken = ScriptArguments(**{**vars(script_args), field: value})
        with pytest.raises(ValueError, match=match):
            load_recipe_datasets(broken)
    math_recipe = ScriptArguments(dataset_name="aime-2024", reasoning_gym_config="{}")
    with pytest.raises(ValueError, match="reasoning_gym_config is set but no dataset"):
        load_recipe_datasets(math_recipe)


def test_a_recipe_s_worked_steps_reach_its_training_and_held_out_prompts():
    config = {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1, "operators": ["+"]}
    config.update(allow_parentheses=False, allow_negation=False)
    script_args = ScriptArguments(
        dataset_name="reasoning_gym:basic_arithmetic",
        eval_dataset_name="reasoning_gym:basic_arithmetic",
        max_train_samples=6,
        max_eval_samples=6,
        reasoning_gym_config=json.dumps(config),
        reasoning_gym_few_shot=2,
        reasoning_gym_worked_steps=True,
    )
    train, held_out = load_recipe_datasets(script_args, seed=3)
    expected = load_reasoning_gym("basic_arithmetic", 6, seed=3, config=config, few_shot=2, worked_steps=True)
    assert train["prompt"] == expected["prompt"]
    for dataset in (train, held_out):
        example = dataset[0]["prompt"][1]["content"]  # the first solved example's answer turn
        assert len(example.split("\n")) == 3  # two additions, one a line, then the tagged answer
    broken = ScriptArguments(**{**vars(script_args), "reasoning_gym_few_shot": 0})
    with pytest.raises(ValueError, match=r"^reasoning_gym_worked_steps shapes the solved examples"):
        load_recipe_datasets(broken)
    math_recipe = ScriptArguments(dataset_name="aime-2024", reasoning_gym_worked_steps=True)
    with pytest.raises(ValueError, match=r"^reasoning_gym_worked_steps is set but no dataset"):
        load_recipe_datasets(math_recipe)
    with pytest.raises(ValueError, match="worked_steps shapes the solved examples, but few_shot is 0"):
        load_reasoning_gym("basic_arithmetic", 2, config=config, worked_steps=True)


# --------------------------------------------------------------------------------------------------
# GGUF path resolution (no model loads here)
# --------------------------------------------------------------------------------------------------
def write_tiny_gguf(path) -> bytes:
    """A small well-formed GGUF file (metadata, a 3-token vocabulary, two float32 tensors); its bytes."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("token_embd.weight", np.ones((3, 8), np.float32))
    writer.add_tensor("output_norm.weight", np.ones((8,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def test_gguf_paths_resolve_to_folder_and_file(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    path = tmp_path / "m.Q4_1.gguf"
    write_tiny_gguf(path)
    source, kwargs = resolve_pretrained(str(path), "model", {"dtype": "float32"})
    assert (source, kwargs) == (str(tmp_path), {"dtype": "float32", "gguf_file": "m.Q4_1.gguf"})
    # or a folder plus gguf_file in model_init_kwargs
    assert resolve_pretrained(str(tmp_path), "model", {"gguf_file": "m.Q4_1.gguf"})[0] == str(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^model: no such GGUF file '.*missing.gguf'\.$"):
        resolve_pretrained(str(tmp_path / "missing.gguf"), "model")
    with pytest.raises(FileNotFoundError, match=r"holds no GGUF file 'other\.gguf'"):
        resolve_pretrained(str(tmp_path), "value_model", {"gguf_file": "other.gguf"})
    with pytest.raises(ValueError, match="model_init_kwargs names another"):
        resolve_pretrained(str(path), "model", {"gguf_file": "other.gguf"})
    # without the gguf package: one line saying what to install, before anything loads
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real_find_spec(name, *a)
    )
    with pytest.raises(ImportError, match=r"--model is a GGUF file.*pip install 'trl-sae\[gym\]'"):
        resolve_pretrained(str(path), "--model")


def test_a_truncated_or_corrupt_gguf_is_refused_naming_the_file(tmp_path):
    pytest.importorskip("gguf")
    whole = write_tiny_gguf(tmp_path / "whole.gguf")
    data_start = len(whole) - 128  # the two tensors: 3 x 8 + 8 float32 values, at the end of the file
    assert resolve_pretrained(str(tmp_path / "whole.gguf"), "model")[1] == {"gguf_file": "whole.gguf"}
    cut = tmp_path / "cut.gguf"
    # `head -c`: cut inside the tensor data, at its start, or one byte short of the end.
    for size in (data_start + 50, data_start, len(whole) - 1):
        cut.write_bytes(whole[:size])
        with pytest.raises(ValueError) as info:
            resolve_pretrained(str(cut), "--model")
        assert str(info.value) == (
            f"--model: GGUF file '{cut}' is truncated: it has {size:,} bytes but its tensors end at byte "
            f"{len(whole):,}; download or copy it again."
        )
    # Cut inside the metadata: the header's lengths run past the end.
    for size in (10, 100, 200):
        cut.write_bytes(whole[:size])
        with pytest.raises(
            ValueError, match=rf"^--model: GGUF file '{cut}' is truncated or corrupt: its metadata"
        ):
            resolve_pretrained(str(cut), "--model")
    # A folder plus gguf_file is checked the same way.
    with pytest.raises(ValueError, match=rf"^value_model: GGUF file '{cut}' is truncated or corrupt"):
        resolve_pretrained(str(tmp_path), "value_model", {"gguf_file": "cut.gguf"})
    cut.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"^--model: GGUF file '{cut}' is empty \(0 bytes\)"):
        resolve_pretrained(str(cut), "--model")
    cut.write_bytes(b"hello world" * 10)
    with pytest.raises(
        ValueError, match=rf"^--model: '{cut}' is not a GGUF file: it starts with b'hell', not"
    ):
        resolve_pretrained(str(cut), "--model")


def test_cli_names_the_truncated_gguf_file_not_its_folder(capsys, tmp_path):
    pytest.importorskip("gguf")
    from trl_sae.cli.app import main

    whole = write_tiny_gguf(tmp_path / "whole.gguf")
    cut = tmp_path / "t.gguf"
    cut.write_bytes(whole[: len(whole) - 60])
    assert main(["segstats", "--model", str(cut), "--task", "running-sum"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.splitlines()[0] == (
        f"trl-sae segstats: error: --model: GGUF file '{cut}' is truncated: it has {len(whole) - 60:,} bytes "
        f"but its tensors end at byte {len(whole):,}; download or copy it again."
    )


def test_a_gguf_model_cannot_be_quantized_again_while_loading(tmp_path):
    from transformers import AutoModelForCausalLM

    with pytest.raises(
        ValueError, match="load_in_4bit / quantization_config: a GGUF model loads dequantized"
    ):
        from_pretrained_dense(
            AutoModelForCausalLM, str(tmp_path), gguf_file="m.gguf", quantization_config=object()
        )


def test_cli_model_arguments_take_gguf_paths(capsys, tmp_path):
    from trl_sae.cli.app import main

    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    missing = tmp_path / "missing.Q4_1.gguf"
    assert main(["eval", "--model", str(missing), "--datasets", str(problems)]) == 1
    err = capsys.readouterr().err
    assert f"--model: no such GGUF file '{missing}'" in err and "Traceback" not in err
