"""Tests for trl_sae.data, offline: Hub downloads are replaced by small in-memory look-alikes."""

from __future__ import annotations

import json

import datasets
import pytest
from datasets import Dataset, DatasetDict

from trl_sae import data
from trl_sae.data import (
    DEFAULT_INSTRUCTION,
    MATH_DATASETS,
    DatasetUnavailableError,
    MathDatasetSpec,
    load_math_dataset,
    prepare_prompt_dataset,
)

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def dapo_rows(repeats: int = 3) -> list[dict]:
    """Rows shaped like BytedTsinghua-SIA/DAPO-Math-17k, each problem repeated as on the Hub."""
    problems = [("What is $1+1$?", "2"), ("Find $x>0$ with $x^2 = 9$.", "3")]
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": DAPO_TEMPLATE.format(problem), "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lax"},
            "extra_info": {"index": f"{k}-{answer}"},
        }
        for k in range(repeats)
        for problem, answer in problems
    ]


HUB_LOOKALIKES = {
    "BytedTsinghua-SIA/DAPO-Math-17k": lambda: Dataset.from_list(dapo_rows()),
    "HuggingFaceH4/aime_2024": lambda: Dataset.from_dict(
        {
            "id": [60, 61],
            "problem": ["Find the number of ways ...", "Let $x$ be ..."],
            "solution": ["... so 204.", "... so 25."],
            "answer": ["204", "025"],
            "url": ["https://example.org/1", "https://example.org/2"],
            "year": ["2024", "2024"],
        }
    ),
    "yentinglin/aime_2025": lambda: Dataset.from_dict(
        {
            "id": ["0", "1"],
            "problem": ["Find the sum ...", "On $\\triangle ABC$ ..."],
            "answer": ["70", "588"],
        }
    ),
    "AI-MO/aimo-validation-amc": lambda: Dataset.from_dict(
        {
            "id": [0, 1],
            "problem": ["What is $\\frac{1}{2}+\\frac{1}{4}$?", "How many ..."],
            "answer": [0.75, 142.0],
            "url": ["u0", "u1"],
        }
    ),
    "ByteDance-Seed/BeyondAIME": lambda: Dataset.from_dict(
        {"problem": ["Determine the least ...", "Compute ..."], "answer": ["123", "\\frac{7}{3}"]}
    ),
}


@pytest.fixture
def fake_hub(monkeypatch):
    """Replace datasets.load_dataset with look-alikes of the Hub datasets; record the calls."""
    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append({"path": path, "name": name, "split": split, **kwargs})
        if path not in HUB_LOOKALIKES:
            raise datasets.exceptions.DatasetNotFoundError(f"Dataset '{path}' doesn't exist on the Hub")
        dataset = HUB_LOOKALIKES[path]()
        return dataset if split else DatasetDict({"train": dataset})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return calls


def user_content(example) -> str:
    (message,) = example["prompt"]
    assert message["role"] == "user"
    return message["content"]


# --------------------------------------------------------------------------------------------------
# The registry and Hub loading.
# --------------------------------------------------------------------------------------------------
def test_registry_lists_the_papers_datasets():
    assert {name: spec.hub_id for name, spec in MATH_DATASETS.items()} == {
        "dapo-math-17k": "BytedTsinghua-SIA/DAPO-Math-17k",
        "aime-2024": "HuggingFaceH4/aime_2024",
        "aime-2025": "yentinglin/aime_2025",
        "amc": "AI-MO/aimo-validation-amc",
        "beyond-aime": "ByteDance-Seed/BeyondAIME",
    }
    assert MATH_DATASETS["beyond-aime"].split == "test"
    assert MATH_DATASETS["dapo-math-17k"].answer_column == "reward_model.ground_truth"
    assert MATH_DATASETS["dapo-math-17k"].deduplicate


def test_dapo_is_deduplicated_and_its_template_replaced(fake_hub):
    ds = load_math_dataset("dapo-math-17k")
    assert fake_hub == [
        {"path": "BytedTsinghua-SIA/DAPO-Math-17k", "name": None, "split": "train", "cache_dir": None}
    ]
    assert ds.column_names == ["prompt", "answer"]
    assert len(ds) == 2  # 6 rows, 2 distinct problems
    assert ds["answer"] == ["2", "3"]
    assert user_content(ds[0]) == f"What is $1+1$?\n\n{DEFAULT_INSTRUCTION}"
    assert "Answer:" not in user_content(ds[1])
    assert load_math_dataset("dapo-math-17k", deduplicate=False).num_rows == 6


@pytest.mark.parametrize(
    ("name", "hub_id", "split", "answers"),
    [
        ("aime-2024", "HuggingFaceH4/aime_2024", "train", ["204", "025"]),
        ("AIME_2025", "yentinglin/aime_2025", "train", ["70", "588"]),
        ("amc", "AI-MO/aimo-validation-amc", "train", ["0.75", "142"]),  # floats from the Hub -> text
        ("ByteDance-Seed/BeyondAIME", "ByteDance-Seed/BeyondAIME", "test", ["123", "\\frac{7}{3}"]),
    ],
)
def test_evaluation_sets(fake_hub, name, hub_id, split, answers):
    ds = load_math_dataset(name)
    assert (fake_hub[0]["path"], fake_hub[0]["split"]) == (hub_id, split)
    assert ds.column_names == ["prompt", "answer"]
    assert ds["answer"] == answers
    problem = HUB_LOOKALIKES[hub_id]()["problem"][0]
    assert user_content(ds[0]) == f"{problem}\n\n{DEFAULT_INSTRUCTION}"


def test_prompt_options(fake_hub):
    plain = load_math_dataset("aime-2024", chat=False, instruction=None)
    assert plain[0]["prompt"] == "Find the number of ways ..."
    custom = load_math_dataset("aime-2024", chat=False, instruction="Answer in \\boxed{}.")
    assert custom[0]["prompt"] == "Find the number of ways ...\n\nAnswer in \\boxed{}."
    with_system = load_math_dataset("aime-2024", system_prompt="You are a careful mathematician.")
    assert with_system[0]["prompt"][0] == {"role": "system", "content": "You are a careful mathematician."}
    assert with_system[0]["prompt"][1]["role"] == "user"
    load_math_dataset("aime-2024", split="train[:1]", cache_dir="/tmp/somewhere")
    assert fake_hub[-1]["split"] == "train[:1]" and fake_hub[-1]["cache_dir"] == "/tmp/somewhere"


def test_output_feeds_math_accuracy(fake_hub):
    pytest.importorskip("math_verify")
    from trl_sae.rewards.math import math_accuracy

    ds = load_math_dataset("amc")
    scores = math_accuracy(ds["prompt"], [r"\boxed{\frac34}", r"\boxed{142}"], None, answer=ds["answer"])
    assert scores == [1.0, 1.0]


def test_unregistered_hub_id_detects_columns(fake_hub, monkeypatch):
    monkeypatch.setitem(HUB_LOOKALIKES, "someone/dapo-copy", lambda: Dataset.from_list(dapo_rows(repeats=2)))
    ds = load_math_dataset("someone/dapo-copy")
    assert fake_hub[-1]["split"] == "train"
    assert len(ds) == 2 and ds["answer"] == ["2", "3"]  # detected as DAPO's layout, deduplicated too


def test_missing_column_is_named(fake_hub, monkeypatch):
    broken = Dataset.from_list([{k: v for k, v in row.items() if k != "reward_model"} for row in dapo_rows()])
    monkeypatch.setitem(HUB_LOOKALIKES, "BytedTsinghua-SIA/DAPO-Math-17k", lambda: broken)
    with pytest.raises(
        ValueError, match=r"no column 'reward_model\.ground_truth' \(answer_column\).*answer_column="
    ):
        load_math_dataset("dapo-math-17k")
    # A struct that lost its field is reported the same way.
    renamed = Dataset.from_list([{**row, "reward_model": {"gt": "1"}} for row in dapo_rows()])
    monkeypatch.setitem(HUB_LOOKALIKES, "BytedTsinghua-SIA/DAPO-Math-17k", lambda: renamed)
    with pytest.raises(ValueError, match=r"no column 'reward_model\.ground_truth'"):
        load_math_dataset("dapo-math-17k")
    # ... and the fix the message suggests works.
    assert load_math_dataset("dapo-math-17k", answer_column="reward_model.gt")["answer"] == ["1", "1"]


def test_empty_dataset_is_an_error(fake_hub, monkeypatch):
    monkeypatch.setitem(
        HUB_LOOKALIKES, "HuggingFaceH4/aime_2024", lambda: Dataset.from_dict({"problem": [], "answer": []})
    )
    with pytest.raises(ValueError, match="is empty"):
        load_math_dataset("aime-2024")


def test_unknown_name():
    with pytest.raises(ValueError, match=r"unknown math dataset 'aime-2030'.*'aime-2024'"):
        load_math_dataset("aime-2030")


# --------------------------------------------------------------------------------------------------
# Offline.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "error",
    [
        ConnectionError("Couldn't reach 'BytedTsinghua-SIA/DAPO-Math-17k' on the Hub (OfflineModeIsEnabled)"),
        ConnectionError(
            "Couldn't reach 'BytedTsinghua-SIA/DAPO-Math-17k' on the Hub (LocalEntryNotFoundError)"
        ),
        TimeoutError("read timed out"),
    ],
)
def test_offline_error_says_how_to_download(monkeypatch, error):
    def load_dataset(*args, **kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DatasetUnavailableError) as info:
        load_math_dataset("dapo-math-17k")
    message = str(info.value)
    assert isinstance(info.value, ConnectionError)
    assert info.value.__cause__ is error
    assert "'BytedTsinghua-SIA/DAPO-Math-17k' (split 'train')" in message
    assert (
        "hf download BytedTsinghua-SIA/DAPO-Math-17k --repo-type dataset --local-dir DAPO-Math-17k" in message
    )
    assert "huggingface-cli download" in message
    assert 'load_math_dataset("path/to/DAPO-Math-17k")' in message
    assert "HF_DATASETS_OFFLINE=1" in message


def test_an_unreachable_hub_is_found_at_once_and_only_the_cache_is_searched(monkeypatch):
    """Online mode without network: one quick request finds the Hub unreachable, and `datasets` is asked for
    its cached copy only (offline), instead of retrying for 30-60 s."""
    from huggingface_hub import constants

    import trl_sae.hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(trl_sae.hub, "hub_unreachable", lambda endpoint: "ConnectError: no route to host")
    seen = []

    def load_dataset(*args, **kwargs):
        seen.append((datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE))
        raise ConnectionError("Couldn't find cache for HuggingFaceH4/aime_2024")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DatasetUnavailableError, match="cannot be reached: ConnectError: no route to host"):
        load_math_dataset("aime-2024")
    assert seen == [(True, True)]
    assert (datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE) == (False, False)  # put back


@pytest.mark.parametrize("client", ["httpx", "httpx2"])
def test_raw_http_client_errors_are_wrapped_too(monkeypatch, client):
    httpx = pytest.importorskip(client)

    def load_dataset(*args, **kwargs):
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DatasetUnavailableError, match="HuggingFaceH4/aime_2024"):
        load_math_dataset("aime-2024")


def test_non_network_errors_pass_through(monkeypatch):
    def load_dataset(*args, **kwargs):
        raise ValueError("Unknown split 'validation'. Should be one of ['train'].")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(ValueError, match="Unknown split"):
        load_math_dataset("aime-2024", split="validation")


# --------------------------------------------------------------------------------------------------
# Local paths.
# --------------------------------------------------------------------------------------------------
def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def test_local_jsonl_aime_layout(tmp_path):
    path = write_jsonl(tmp_path / "aime.jsonl", [{"id": 1, "problem": "Find $n$.", "answer": "17"}])
    ds = load_math_dataset(str(path), cache_dir=str(tmp_path / "cache"))
    assert ds.column_names == ["prompt", "answer"]
    assert ds[0] == {
        "prompt": [{"role": "user", "content": f"Find $n$.\n\n{DEFAULT_INSTRUCTION}"}],
        "answer": "17",
    }
    # A pathlib.Path works too, and the split name of a single-file dataset does not matter.
    assert load_math_dataset(path, split="test", chat=False, cache_dir=str(tmp_path / "cache")).num_rows == 1


def test_local_jsonl_dapo_layout_is_detected_and_deduplicated(tmp_path):
    path = write_jsonl(tmp_path / "dapo.jsonl", dapo_rows(repeats=4))
    ds = load_math_dataset(str(path), cache_dir=str(tmp_path / "cache"))
    assert len(ds) == 2 and ds["answer"] == ["2", "3"]
    assert user_content(ds[1]) == f"Find $x>0$ with $x^2 = 9$.\n\n{DEFAULT_INSTRUCTION}"


def test_local_parquet_and_custom_columns(tmp_path):
    path = tmp_path / "mine.parquet"
    Dataset.from_dict({"question": ["2+2?", "3+3?"], "final": [4, 6]}).to_parquet(str(path))
    with pytest.raises(
        ValueError, match=r"columns \['question', 'final'\].*problem_column= and answer_column="
    ):
        load_math_dataset(str(path), cache_dir=str(tmp_path / "cache"))
    ds = load_math_dataset(
        str(path), problem_column="question", answer_column="final", cache_dir=str(tmp_path / "cache")
    )
    assert ds["answer"] == ["4", "6"]
    assert user_content(ds[0]).startswith("2+2?\n\n")


def test_local_save_to_disk_roundtrip_keeps_one_instruction(tmp_path, fake_hub):
    saved = tmp_path / "amc_formatted"
    load_math_dataset("amc").save_to_disk(str(saved))
    again = load_math_dataset(str(saved))  # already prompt + answer: the instruction is not added twice
    assert again.column_names == ["prompt", "answer"]
    assert user_content(again[0]).count(DEFAULT_INSTRUCTION) == 1
    assert again["answer"] == ["0.75", "142"]


def test_local_dataset_dict_needs_a_split(tmp_path):
    saved = tmp_path / "both"
    rows = {"problem": ["a"], "answer": ["1"]}
    DatasetDict({"train": Dataset.from_dict(rows), "test": Dataset.from_dict(rows)}).save_to_disk(str(saved))
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\]; pass split="):
        load_math_dataset(str(saved))
    assert load_math_dataset(str(saved), split="test").num_rows == 1


def test_local_hf_download_folder(tmp_path):
    # `hf download ... --local-dir` gives a folder of data files; datasets' folder loader reads it.
    folder = tmp_path / "BeyondAIME" / "data"
    folder.mkdir(parents=True)
    Dataset.from_dict({"problem": ["p1", "p2"], "answer": ["1", "2"]}).to_parquet(
        str(folder / "test-00000.parquet")
    )
    ds = load_math_dataset(str(tmp_path / "BeyondAIME"), cache_dir=str(tmp_path / "cache"))
    assert ds["answer"] == ["1", "2"]


def test_local_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file or folder"):
        load_math_dataset(str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match="no file or folder"):
        load_math_dataset("./not/here")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"use a \.json, \.jsonl, \.parquet"):
        load_math_dataset(str(tmp_path / "notes.txt"))


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("empty.jsonl", ""),  # datasets' json builder raised a bare StopIteration
        ("blank.jsonl", "\n\n  \n"),
        ("empty.json", ""),
        ("list.json", "[]"),
        ("empty.csv", ""),
        ("header.csv", "problem,answer\n"),
    ],
)
def test_a_local_file_without_rows_is_one_clear_error(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError) as error:
        load_math_dataset(str(path))
    message = str(error.value)
    assert message.startswith(f"{str(path)!r} has no rows: put one problem per row with its answer")
    assert "\n" not in message


def test_spec_object(fake_hub):
    spec = MathDatasetSpec(hub_id="HuggingFaceH4/aime_2024", split="train", answer_column="solution")
    assert load_math_dataset(spec, chat=False)["answer"] == ["... so 204.", "... so 25."]


# --------------------------------------------------------------------------------------------------
# prepare_prompt_dataset.
# --------------------------------------------------------------------------------------------------
def test_prepare_prompt_dataset_renames_and_passes_through():
    ds = Dataset.from_dict({"question": ["1+1?"], "solution": ["2"], "level": [1]})
    out = prepare_prompt_dataset(ds, prompt_column="question", answer_column="solution")
    assert out.column_names == ["prompt", "answer", "level"]
    canonical = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]], "answer": ["2"]})
    assert prepare_prompt_dataset(canonical) is canonical
    no_answers = Dataset.from_dict({"prompt": ["write a poem"]})
    assert prepare_prompt_dataset(no_answers, answer_column=None).column_names == ["prompt"]


@pytest.mark.parametrize(
    ("dataset", "kwargs", "message"),
    [
        (
            Dataset.from_dict({"question": ["q"], "answer": ["1"]}),
            {},
            r"no column 'prompt' \(prompt_column\)",
        ),
        (
            Dataset.from_dict({"prompt": ["q"], "solution": ["1"]}),
            {},
            r"no column 'answer' \(answer_column\)",
        ),
        (Dataset.from_dict({"prompt": [], "answer": []}), {}, "empty: column 'prompt' has no prompts"),
        (
            Dataset.from_dict({"prompt": [""], "answer": ["1"]}),
            {},
            "column 'prompt' must hold non-empty text",
        ),
        (Dataset.from_dict({"prompt": [3], "answer": ["1"]}), {}, "column 'prompt' must hold non-empty text"),
        (
            Dataset.from_dict({"q": ["x"], "prompt": ["y"], "answer": ["1"]}),
            {"prompt_column": "q"},
            "cannot rename column 'q' to 'prompt'",
        ),
        (DatasetDict({"train": Dataset.from_dict({"prompt": ["q"]})}), {}, "pass one split"),
        ({"prompt": ["q"]}, {}, "expected a datasets.Dataset"),
    ],
)
def test_prepare_prompt_dataset_errors(dataset, kwargs, message):
    with pytest.raises(ValueError, match=message):
        prepare_prompt_dataset(dataset, **kwargs)


def test_module_does_not_import_datasets_eagerly():
    # `import trl_sae` stays light for users of the math core; datasets loads on first use.
    with open(data.__file__, encoding="utf-8") as f:
        source = f.read()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not any("datasets" in line for line in top_level)
