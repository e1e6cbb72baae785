"""STEM datasets (GPQA-style options, SCP-style free-form problems), `trl-sae eval` and `trl-sae train` on them,
and the paper's STEM recipe: every dataset is a local file the test writes; nothing is downloaded."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from trl_sae.cli.app import main
from trl_sae.demo.tiny import build_tiny_qwen3
from trl_sae.recipe import ScriptArguments, load_recipe_datasets, parse_recipe, run_recipe
from trl_sae.rewards.multiple_choice import LETTERS
from trl_sae.stem import (
    STEM_DATASETS,
    load_multiple_choice_dataset,
    load_science_dataset,
    load_stem_dataset,
    parse_stem_name,
)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEM_RECIPE = EXAMPLES / "qwen3_4b_base_stem.yaml"

GPQA_ROWS = [
    {
        "Question": f"Question {i}: which speed is right?",
        "Correct Answer": f"{i}.5 m/s",
        "Incorrect Answer 1": f"{i}.1 m/s",
        "Incorrect Answer 2": f"{i}.2 m/s",
        "Incorrect Answer 3": f"{i}.3 m/s",
        "Subdomain": "Physics",
    }
    for i in range(6)
]
SCP_ROWS = [
    {"problem": f"A car covers {4 * i} m in 4 s. Its speed?", "answer": f"{i} m/s"} for i in range(1, 7)
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def gpqa_jsonl(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("gpqa") / "gpqa.jsonl", GPQA_ROWS)


@pytest.fixture(scope="module")
def scp_jsonl(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("scp") / "scp.jsonl", SCP_ROWS)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-policy")
    build_tiny_qwen3(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# --------------------------------------------------------------------------------------------------
# Loaders.
# --------------------------------------------------------------------------------------------------
def test_multiple_choice_rows_become_lettered_shuffled_options(gpqa_jsonl):
    dataset = load_multiple_choice_dataset(gpqa_jsonl, chat=False)
    assert dataset.column_names == ["prompt", "answer", "choices"] and len(dataset) == 6
    for row, source in zip(dataset, GPQA_ROWS):
        assert sorted(row["choices"]) == sorted(source[k] for k in source if "Answer" in k)
        assert row["choices"][LETTERS.index(row["answer"])] == source["Correct Answer"]
        listing = "\n".join(f"{LETTERS[k]}) {text}" for k, text in enumerate(row["choices"]))
        assert row["prompt"].startswith(f"{source['Question']}\n\n{listing}\n\n")
        assert row["prompt"].endswith("put the letter of the correct option within \\boxed{}.")
    # The correct option is not always A: the shuffle moves it (6 rows, fixed seed, fixed outcome).
    assert len(set(dataset["answer"])) > 1


def test_the_option_order_is_a_function_of_the_seed_and_the_question_alone(gpqa_jsonl, tmp_path):
    first = load_multiple_choice_dataset(gpqa_jsonl)
    again = load_multiple_choice_dataset(gpqa_jsonl)
    assert first["choices"] == again["choices"] and first["answer"] == again["answer"]
    # Rows in another order, in another format: each question keeps its options' order.
    from datasets import Dataset

    parquet = tmp_path / "gpqa.parquet"
    Dataset.from_list(GPQA_ROWS[::-1]).to_parquet(str(parquet))
    reordered = load_multiple_choice_dataset(parquet)
    assert reordered["choices"][::-1] == first["choices"]
    json_file = tmp_path / "gpqa.json"
    json_file.write_text(json.dumps(GPQA_ROWS))
    assert load_multiple_choice_dataset(json_file)["answer"] == first["answer"]
    other_seed = load_multiple_choice_dataset(gpqa_jsonl, seed=1)
    assert other_seed["choices"] != first["choices"]
    assert first["prompt"][0][0]["role"] == "user"  # chat messages by default


def test_multiple_choice_errors_name_the_row_and_the_column(tmp_path, gpqa_jsonl):
    rows = [dict(GPQA_ROWS[0]), dict(GPQA_ROWS[1])]
    rows[1]["Incorrect Answer 2"] = None
    with pytest.raises(ValueError) as error:
        load_multiple_choice_dataset(write_jsonl(tmp_path / "holes.jsonl", rows))
    message = str(error.value)
    assert "row 1 has no value in column 'Incorrect Answer 2'" in message and "\n" not in message
    with pytest.raises(ValueError, match=r"has no column 'Question text' \(question_column\)"):
        load_multiple_choice_dataset(gpqa_jsonl, question_column="Question text")
    with pytest.raises(ValueError, match=r"incorrect_columns: give 1 to 9 columns"):
        load_multiple_choice_dataset(gpqa_jsonl, incorrect_columns=[])
    with pytest.raises(FileNotFoundError, match="no file or folder"):
        load_multiple_choice_dataset(tmp_path / "missing.jsonl")


def test_science_rows_take_the_answer_or_the_last_boxed_answer_of_the_solution(tmp_path, scp_jsonl, caplog):
    dataset = load_science_dataset(scp_jsonl, chat=False, instruction=None)
    assert dataset.column_names == ["prompt", "answer"]
    assert dataset["answer"] == [row["answer"] for row in SCP_ROWS]
    assert dataset["prompt"] == [row["problem"] for row in SCP_ROWS]
    solutions = [
        {"problem": "p0", "matched_solution": "v = d/t = \\boxed{2 m/s}", "domain": "physics"},
        {"problem": "p1", "matched_solution": "So the mass is 3 kg.", "domain": "physics"},
        {
            "problem": "p2",
            "matched_solution": "first \\boxed{1}, finally \\boxed{\\frac{1}{2}\\ \\mathrm{J}}",
        },
    ]
    path = write_jsonl(tmp_path / "scp_solutions.jsonl", solutions)
    with caplog.at_level(logging.WARNING, logger="trl_sae.stem"):
        dataset = load_science_dataset(path)
    assert dataset["answer"] == ["2 m/s", "\\frac{1}{2}\\ \\mathrm{J}"]
    assert "dropped 1 of 3 rows whose 'matched_solution' has no \\boxed{} final answer" in caplog.text
    unboxed = write_jsonl(tmp_path / "unboxed.jsonl", [solutions[1]])
    with pytest.raises(
        ValueError, match=r"no solution in column 'matched_solution' ends in a \\boxed\{\} answer"
    ):
        load_science_dataset(unboxed)


def test_science_errors_name_the_row_and_the_column(tmp_path):
    rows = [*SCP_ROWS[:2], {"problem": "  ", "answer": "1 m"}]
    with pytest.raises(ValueError, match=r"row 2 has no value in column 'problem'; fill it or drop the row"):
        load_science_dataset(write_jsonl(tmp_path / "blank.jsonl", rows))
    rows = [SCP_ROWS[0], {"problem": "p"}]
    with pytest.raises(ValueError, match=r"row 1 has no value in column 'answer'"):
        load_science_dataset(write_jsonl(tmp_path / "no_answer.jsonl", rows))
    with pytest.raises(ValueError, match=r"no 'answer' column and no solution column"):
        load_science_dataset(write_jsonl(tmp_path / "bare.jsonl", [{"problem": "p", "gold": "1"}]))
    with pytest.raises(ValueError, match="pass answer_column or solution_column, not both"):
        load_science_dataset("scp-116k", answer_column="a", solution_column="s")
    with pytest.raises(ValueError, match="'gpqa-diamond' is a multiple_choice dataset, not a science one"):
        load_science_dataset("gpqa-diamond")


@pytest.mark.parametrize("name", sorted(STEM_DATASETS))
def test_named_datasets_load_through_datasets_load_dataset(monkeypatch, name):
    """The Hub path is datasets.load_dataset with the spec's id, config and split (replaced here: no network)."""
    from datasets import Dataset

    calls = []
    rows = (
        GPQA_ROWS
        if STEM_DATASETS[name].kind == "multiple_choice"
        else [{"problem": "p", "matched_solution": "\\boxed{3 K}"}]
    )

    def fake_load_dataset(path, name=None, split=None, cache_dir=None):
        calls.append((path, name, split))
        return Dataset.from_list(rows)

    monkeypatch.setattr("datasets.load_dataset", fake_load_dataset)
    monkeypatch.setattr("trl_sae.data._hub_unreachable_reason", lambda: None)
    dataset, reward = load_stem_dataset(name)
    spec = STEM_DATASETS[name]
    assert calls == [(spec.hub_id, spec.config_name, "train")]
    assert reward == {"multiple_choice": "multiple_choice_accuracy", "science": "science_accuracy"}[spec.kind]
    assert len(dataset) == len(rows)
    load_stem_dataset(f"{spec.kind}:someone/their-set", split="test")
    assert calls[-1] == ("someone/their-set", None, "test")


def test_stem_names():
    assert parse_stem_name("GPQA_Diamond") == ("multiple_choice", "gpqa-diamond")
    assert parse_stem_name("scp-116k") == ("science", "scp-116k")
    assert parse_stem_name("multiple_choice:data/gpqa.jsonl") == ("multiple_choice", "data/gpqa.jsonl")
    assert parse_stem_name("science: owner/name") == ("science", "owner/name")
    assert parse_stem_name("dapo-math-17k") is None and parse_stem_name("reasoning_gym:chain_sum") is None
    with pytest.raises(ValueError, match="name a local file or a Hub id after 'science:'"):
        parse_stem_name("science:")


# --------------------------------------------------------------------------------------------------
# trl-sae eval.
# --------------------------------------------------------------------------------------------------
def test_eval_grades_options_and_free_form_answers(
    capsys, monkeypatch, tiny_dir, gpqa_jsonl, scp_jsonl, tmp_path
):
    """Canned completions: the option of the right letter for the even GPQA rows, the option's text for
    row 1, a wrong letter for the rest; the right speed in another unit for the first 3 SCP rows."""
    options = load_multiple_choice_dataset(gpqa_jsonl)

    def fake_generate(
        model, tokenizer, prompts, max_new_tokens, temperature, num_samples, batch_size, progress
    ):
        texts = []
        for prompt in prompts:
            text = prompt[-1]["content"]
            if "Question" in text:
                i = int(text.split(":")[0].split()[-1])
                letter = options[i]["answer"]
                wrong = LETTERS[(LETTERS.index(letter) + 1) % 4]
                if i == 1:
                    texts.append(f"The answer is {GPQA_ROWS[1]['Correct Answer']}.")
                else:
                    texts.append(f"\\boxed{{{letter if i % 2 == 0 else wrong}}}")
            else:
                i = int(text.split("covers ")[1].split()[0]) // 4
                texts.append(f"\\boxed{{{i * 3.6:.2f} km/h}}" if i <= 3 else "\\boxed{7 m}")
        return texts, [[1]] * len(texts)

    monkeypatch.setattr("trl_sae.evaluation.generate_completions", fake_generate)
    output = tmp_path / "eval.json"
    code = main(
        ["eval", "--model", str(tiny_dir), "--datasets", f"multiple_choice:{gpqa_jsonl}", f"science:{scp_jsonl}",
         "--output", str(output), "--no-progress"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err
    results = json.loads(output.read_text())["results"]
    # GPQA: rows 0, 2, 4 by letter and row 1 by text are right; rows 3 and 5 wrong.
    assert results[f"multiple_choice:{gpqa_jsonl}"]["per_problem"] == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    assert results[f"science:{scp_jsonl}"]["accuracy"] == pytest.approx(3 / 6)


def test_eval_on_a_tiny_model_generates_and_grades_both_kinds(
    capsys, tiny_dir, gpqa_jsonl, scp_jsonl, tmp_path
):
    """The real path: greedy generation from the tiny model, graded by each dataset's reward."""
    output = tmp_path / "eval.json"
    code = main(
        ["eval", "--model", str(tiny_dir), "--datasets", f"multiple_choice:{gpqa_jsonl}", f"science:{scp_jsonl}",
         "--limit", "2", "--max-new-tokens", "4", "--output", str(output), "--no-progress"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    results = json.loads(output.read_text())["results"]
    for name in (f"multiple_choice:{gpqa_jsonl}", f"science:{scp_jsonl}"):
        assert results[name]["num_prompts"] == 2 and 0.0 <= results[name]["accuracy"] <= 1.0
        assert name in out


def test_eval_reports_a_bad_stem_dataset_in_one_line(capsys, tiny_dir, tmp_path):
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"Question": "q", "Correct Answer": "a"}])
    code = main(["eval", "--model", str(tiny_dir), "--datasets", f"multiple_choice:{bad}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"trl-sae eval: error: dataset 'multiple_choice:{bad}': {str(bad)!r} has no column 'Incorrect Answer 1' "
        f"(incorrect_columns[0]); its columns are ['Question', 'Correct Answer']. Pass incorrect_columns[0]=... "
        "to map it."
    )


# --------------------------------------------------------------------------------------------------
# Recipes.
# --------------------------------------------------------------------------------------------------
def test_recipe_datasets_of_both_kinds(gpqa_jsonl, scp_jsonl):
    script_args = ScriptArguments(
        dataset_name=f"science:{scp_jsonl}",
        eval_dataset_name=f"multiple_choice:{gpqa_jsonl}",
        max_eval_samples=4,
    )
    train, evaluation = load_recipe_datasets(script_args)
    assert train.column_names == ["prompt", "answer"] and len(train) == 6
    assert evaluation.column_names == ["prompt", "answer", "choices"] and len(evaluation) == 4


def test_the_stem_recipe_is_the_paper_setup_on_the_stem_data():
    paper = yaml.safe_load((EXAMPLES / "paper_qwen3_8b_base.yaml").read_text())
    raw = yaml.safe_load(STEM_RECIPE.read_text())
    differing = {key for key in paper.keys() | raw.keys() if paper.get(key) != raw.get(key)}
    assert differing == {
        "model_name_or_path",
        "dataset_name",
        "eval_dataset_name",
        "reward_funcs",
        "output_dir",
    }
    assert raw["model_name_or_path"] == "Qwen/Qwen3-4B-Base"
    assert (raw["dataset_name"], raw["eval_dataset_name"]) == ("scp-116k", "gpqa-diamond")
    assert raw["reward_funcs"] == ["stem_accuracy"]
    script_args, config = parse_recipe([str(STEM_RECIPE), "--use_cpu", "true", "--bf16", "false"])
    assert config.advantage_estimator == "sae" and config.segment_threshold == 0.2
    assert parse_stem_name(script_args.dataset_name)[0] == "science"
    assert parse_stem_name(script_args.eval_dataset_name)[0] == "multiple_choice"


def test_the_stem_recipe_trains_a_step_and_evaluates_options(tmp_path, tiny_dir, gpqa_jsonl, scp_jsonl):
    """One PPO step of the STEM recipe on the tiny model: the free-form training set and the multiple-choice
    held-out set (its `choices` column reaches stem_accuracy through the trainer's evaluation)."""
    argv = [
        str(STEM_RECIPE),
        "--model_name_or_path", str(tiny_dir),
        "--dataset_name", f"science:{scp_jsonl}",
        "--eval_dataset_name", f"multiple_choice:{gpqa_jsonl}",
        "--output_dir", str(tmp_path / "out"),
        "--bf16", "false", "--use_cpu", "true",
        "--max_steps", "1", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
        "--num_generations", "2", "--response_length", "4", "--value_warmup_steps", "0",
        "--max_eval_samples", "3", "--activation_checkpointing", "false", "--log_completions", "false",
        "--save_strategy", "no", "--eval_on_start", "true", "--local_rollout_forward_batch_size", "4",
    ]  # fmt: skip
    script_args, training_args = parse_recipe(argv)
    summary = run_recipe(script_args, training_args)
    assert summary["reward_funcs"] == ["stem_accuracy"]
    assert summary["train_prompts"] == 6 and summary["eval_prompts"] == 3
    assert 0.0 <= summary["eval/accuracy"] <= 1.0 and "reward/mean" in summary
