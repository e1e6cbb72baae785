"""Math datasets of the SAE paper, as ``prompt`` + ``answer`` datasets ready for the trainer.

Training uses DAPO-Math-17k; evaluation uses AIME 2024, AIME 2025, AMC and BeyondAIME. Every loader returns
a :class:`datasets.Dataset` with two columns:

* ``prompt``: chat messages ``[{"role": "user", "content": problem + instruction}]`` (or the plain text
  with ``chat=False``);
* ``answer``: the gold answer as a string, which :func:`trl_sae.rewards.math_accuracy` reads.

The Hub ids, splits and source columns live in :data:`MATH_DATASETS`. Without network access, download a
dataset elsewhere and pass its local path (see :class:`DatasetUnavailableError`). ``datasets`` is imported
lazily so that ``import trl_sae`` stays light.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset, DatasetDict

__all__ = [
    "DEFAULT_INSTRUCTION",
    "MATH_DATASETS",
    "DatasetUnavailableError",
    "MathDatasetSpec",
    "format_prompt",
    "load_math_dataset",
    "load_rows",
    "prepare_prompt_dataset",
]

#: Appended to every problem: asks for the ``\boxed{}`` answer that math_accuracy and format_reward read.
DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class MathDatasetSpec:
    """Where a math dataset lives and which of its columns hold the problem and the answer.

    Attributes:
        hub_id: the Hugging Face Hub dataset id.
        split: the split to load by default.
        problem_column: the column with the problem: text, or chat messages (the last user turn is used).
        answer_column: the column with the gold answer; a dotted path reads inside a struct column
            (``"reward_model.ground_truth"``).
        config_name: the Hub config (subset), if the dataset has several.
        deduplicate: drop repeated (problem, answer) rows.
        description: one line for listings and error messages.
    """

    hub_id: str
    split: str
    problem_column: str = "problem"
    answer_column: str = "answer"
    config_name: str | None = None
    deduplicate: bool = False
    description: str = ""


#: The paper's datasets by short name. Structures follow the public dataset cards (see each description).
MATH_DATASETS: dict[str, MathDatasetSpec] = {
    "dapo-math-17k": MathDatasetSpec(
        hub_id="BytedTsinghua-SIA/DAPO-Math-17k",
        split="train",
        # Rows: prompt=[{"role": "user", "content": DAPO template around the problem}],
        # reward_model={"ground_truth": "34", "style": "rule-lax"}; each problem appears many times.
        problem_column="prompt",
        answer_column="reward_model.ground_truth",
        deduplicate=True,
        description="DAPO-Math-17k, the training set (about 17k unique problems, integer answers)",
    ),
    "aime-2024": MathDatasetSpec(
        hub_id="HuggingFaceH4/aime_2024",
        split="train",
        description="AIME 2024 I and II, 30 problems (columns id, problem, solution, answer, url, year)",
    ),
    "aime-2025": MathDatasetSpec(
        hub_id="yentinglin/aime_2025",
        split="train",
        description="AIME 2025 I and II, 30 problems (columns problem, answer, ...)",
    ),
    "amc": MathDatasetSpec(
        hub_id="AI-MO/aimo-validation-amc",
        split="train",
        description="AMC 12 2022-2023, 83 problems (answer stored as a float, e.g. 142.0)",
    ),
    "beyond-aime": MathDatasetSpec(
        hub_id="ByteDance-Seed/BeyondAIME",
        split="test",
        description="BeyondAIME, 100 problems harder than AIME (columns problem, answer)",
    ),
}

# DAPO-Math-17k wraps each problem in an instruction to end with "Answer: $Answer"; it would contradict the
# \boxed{} instruction, so it is removed and the bare problem kept.
_DAPO_PREFIX_RE = re.compile(
    r"\A\s*Solve the following math problem step by step\. The last line of your response should be of the "
    r"form Answer: \$Answer \(without quotes\) where \$Answer is the answer to the problem\.\s*"
)
_DAPO_SUFFIX_RE = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*\Z")


class DatasetUnavailableError(ConnectionError):
    """A dataset could not be fetched from the Hub (offline, unreachable, gated or missing).

    The message says how to download it elsewhere and load it from a local path.
    """


def _normalize_name(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _download_help(
    hub_id: str, split: str | None, error: BaseException, loader: str = "load_math_dataset"
) -> str:
    folder = hub_id.rsplit("/", 1)[-1]
    split_text = f" (split {split!r})" if split else ""
    return (
        f"Could not load {hub_id!r}{split_text} from the Hugging Face Hub: {type(error).__name__}: {error}\n"
        "This machine looks offline, or the Hub is unreachable. To use the dataset without network access:\n"
        f"  1. on a machine with access:  hf download {hub_id} --repo-type dataset --local-dir {folder}\n"
        f"     (`huggingface-cli download {hub_id} --repo-type dataset --local-dir {folder}` with "
        "huggingface_hub < 1.0);\n"
        f'  2. copy the folder here and pass its path: {loader}("path/to/{folder}").\n'
        f"Alternatively, run {loader} once with network access to fill the `datasets` cache, then "
        "set HF_DATASETS_OFFLINE=1 (and HF_HUB_OFFLINE=1) to reuse it offline."
    )


def _hub_unreachable_reason() -> str | None:
    """Why the Hub cannot be reached (one line), or None when it answers or offline mode is already on.

    Without network, ``datasets`` spends 30-60 s in retries before it fails; one quick request says so at once.
    """
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    from trl_sae.hub import hub_unreachable

    return hub_unreachable(constants.ENDPOINT)


@contextlib.contextmanager
def _offline_datasets(offline: bool):
    """``datasets`` and ``huggingface_hub`` in offline mode (the local cache only) while the block runs."""
    if not offline:
        yield
        return
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _network_errors() -> tuple[type[BaseException], ...]:
    # datasets wraps most failures in ConnectionError / FileNotFoundError (both OSError); raw transport
    # errors of the HTTP client can still escape, so catch those too where the client is installed.
    errors: list[type[BaseException]] = [OSError]
    for client in ("httpx", "httpx2"):  # huggingface_hub 2.x ships its HTTP client as httpx2
        with contextlib.suppress(ImportError, AttributeError):
            errors.append(importlib.import_module(client).TransportError)
    try:
        import requests

        errors.append(requests.exceptions.RequestException)
    except ImportError:
        pass
    return tuple(errors)


# --------------------------------------------------------------------------------------------------
# Column access.
# --------------------------------------------------------------------------------------------------
def _get_path(row: Mapping[str, Any], path: str) -> Any:
    """``row["a"]["b"]`` for ``path="a.b"``; KeyError if a level is missing."""
    value: Any = row
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            raise KeyError(key)
        value = value[key]
    return value


def _has_path(dataset: Dataset, path: str) -> bool:
    top = path.split(".", 1)[0]
    if top not in dataset.column_names:
        return False
    if "." not in path:
        return True
    if len(dataset) == 0:
        return False
    try:
        _get_path(dataset[0], path)
    except KeyError:
        return False
    return True


def _problem_text(value: Any) -> str:
    """The problem as text: a string, or the content of the last user message of a chat."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        user_turns = [m for m in value if m.get("role", "user") == "user"]
        text = (user_turns or list(value))[-1].get("content") or ""
    else:
        raise ValueError(f"a problem is a {type(value).__name__}; expected text or a list of chat messages.")
    text = _DAPO_PREFIX_RE.sub("", text, count=1)
    text = _DAPO_SUFFIX_RE.sub("", text, count=1)
    return text.strip()


def _answer_text(value: Any) -> str | None:
    """The gold answer as a string (``None`` kept as missing)."""
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # AMC stores 142.0; "142" reads and compares as the integer it is
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 1:
        value = value[0]  # a one-element list of answers
    return str(value).strip()


def format_prompt(problem: str, chat: bool, instruction: str | None, system_prompt: str | None) -> Any:
    """``problem`` with ``instruction`` after a blank line (once), as text or as chat messages (a system
    message first when ``system_prompt`` is given)."""
    content = problem
    # A dataset that already went through this function keeps a single copy of the instruction.
    if instruction and not problem.rstrip().endswith(instruction):
        content = f"{problem}\n\n{instruction}"
    if not chat:
        return content
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": content})
    return messages


# --------------------------------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------------------------------
_LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _pick_split(obj: Dataset | DatasetDict, split: str | None, source: str) -> Dataset:
    from datasets import DatasetDict

    if not isinstance(obj, DatasetDict):
        return obj
    if split is not None and split in obj:
        return obj[split]
    if len(obj) == 1:
        return next(iter(obj.values()))
    raise ValueError(
        f"{source} has splits {sorted(obj)}; pass split= one of them"
        + (f" (no split {split!r})." if split is not None else ".")
    )


# What a local file with no rows should hold, for math datasets (load_rows's other callers name their own).
_MATH_ROW_HINT = (
    "put one problem per row with its answer, e.g. the .jsonl line "
    '{"problem": "What is 2 + 2?", "answer": "4"}.'
)


def _load_local(
    path: Path, split: str | None, cache_dir: str | None, row_hint: str = _MATH_ROW_HINT
) -> Dataset:
    import datasets

    if path.is_dir():
        if any(
            (path / marker).exists() for marker in ("dataset_info.json", "state.json", "dataset_dict.json")
        ):
            obj = datasets.load_from_disk(str(path))  # written by Dataset(Dict).save_to_disk
        else:
            obj = datasets.load_dataset(str(path), cache_dir=cache_dir)  # e.g. a `hf download` folder
    else:
        builder = _LOCAL_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"cannot load {str(path)!r}: use a .json, .jsonl, .parquet, .csv or .arrow file, or a folder "
                "saved with Dataset.save_to_disk."
            )
        if path.stat().st_size == 0:
            raise _no_rows(path, row_hint)
        try:
            obj = datasets.load_dataset(builder, data_files=str(path), cache_dir=cache_dir)
        except StopIteration as error:  # datasets' json builder on a file holding no JSON value
            raise _no_rows(path, row_hint) from error
        except ValueError as error:  # blank lines only, `[]`, a header without rows
            if "corresponds to no data" not in str(error):
                raise
            raise _no_rows(path, row_hint) from error
    return _pick_split(obj, split, repr(str(path)))


def _no_rows(path: Path, row_hint: str) -> ValueError:
    return ValueError(f"{str(path)!r} has no rows: {row_hint}")


def _detect_spec(dataset: Dataset, source: str) -> MathDatasetSpec:
    """The first registered spec whose problem and answer columns the dataset has."""
    candidates = [*MATH_DATASETS.values(), MathDatasetSpec(hub_id="", split="train", problem_column="prompt")]
    for spec in candidates:
        if _has_path(dataset, spec.problem_column) and _has_path(dataset, spec.answer_column):
            return spec
    raise ValueError(
        f"{source} has columns {dataset.column_names}, none of the known layouts "
        "(problem + answer, or DAPO's prompt + reward_model.ground_truth); pass problem_column= and "
        "answer_column= to map them."
    )


def _raw_key(value: Any) -> Any:
    """A hashable stand-in for a cell: duplicated rows are exact copies, so no cleaning is needed."""
    if isinstance(value, Mapping):
        return tuple((k, _raw_key(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return tuple(_raw_key(v) for v in value)
    return value


def _deduplicate(dataset: Dataset, problem_column: str, answer_column: str) -> Dataset:
    # Only the two source columns, in Arrow batches, keyed on raw values: DAPO-Math-17k has ~1.8M rows.
    columns = sorted({problem_column.split(".", 1)[0], answer_column.split(".", 1)[0]})
    seen: set[Any] = set()
    keep: list[int] = []
    index = 0
    for batch in dataset.select_columns(columns).iter(batch_size=8192):
        for values in zip(*(batch[c] for c in columns)):
            key = _raw_key(values)
            if key not in seen:
                seen.add(key)
                keep.append(index)
            index += 1
    return dataset if len(keep) == len(dataset) else dataset.select(keep)


def _existing_path(name: str | os.PathLike[str]) -> Path:
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no file or folder at {str(path)!r}.")
    return path


def _resolve(name: str | os.PathLike[str] | MathDatasetSpec) -> tuple[MathDatasetSpec | None, Path | None]:
    """(spec, local path) for a registry name, a Hub id, a spec or a local path."""
    if isinstance(name, MathDatasetSpec):
        return name, None
    if isinstance(name, os.PathLike):
        return None, _existing_path(name)
    text = str(name).strip()
    # Registry names first, so that a stray folder called e.g. "amc" cannot shadow them.
    key = _normalize_name(text)
    if key in MATH_DATASETS:
        return MATH_DATASETS[key], None
    if os.path.exists(os.path.expanduser(text)):
        return None, Path(os.path.expanduser(text))
    looks_like_path = (
        text.startswith((".", "/", "~"))
        or "\\" in text
        or text.count("/") > 1
        or Path(text).suffix.lower() in _LOCAL_BUILDERS
    )
    if looks_like_path:
        raise FileNotFoundError(f"no file or folder at {text!r}.")
    for spec in MATH_DATASETS.values():
        if spec.hub_id.lower() == text.lower():
            return spec, None
    if text.count("/") == 1:
        # Another Hub dataset: its columns are detected after loading (or given explicitly).
        return MathDatasetSpec(hub_id=text, split="train", problem_column="", answer_column=""), None
    raise ValueError(
        f"unknown math dataset {str(name)!r}: not a local path, not an owner/name Hub id, and not one of "
        f"{sorted(MATH_DATASETS)}."
    )


def load_rows(
    source: str | os.PathLike[str],
    split: str | None = None,
    *,
    config_name: str | None = None,
    default_split: str = "train",
    cache_dir: str | None = None,
    loader: str = "load_math_dataset",
    row_hint: str = _MATH_ROW_HINT,
) -> tuple[Dataset, str]:
    """The raw rows of a local file or folder, or of a Hub dataset, and how messages should name the source.

    ``source`` is local when it exists, starts with ``.``, ``/`` or ``~``, has a data file's suffix or is not
    an ``owner/name`` id; otherwise it is loaded with ``datasets.load_dataset(source, config_name,
    split=split or default_split)`` (only the local cache when the Hub cannot be reached). ``row_hint``
    ends the message for a local file without rows: what a row should hold.

    Raises:
        FileNotFoundError: a local path that does not exist.
        DatasetUnavailableError: the Hub could not be reached; the message says how to download the dataset
            and pass its folder to ``loader`` (the function the user called).
    """
    import datasets

    text = os.fspath(source).strip()
    local = (
        isinstance(source, os.PathLike)
        or os.path.exists(os.path.expanduser(text))
        or text.startswith((".", "/", "~"))
        or "\\" in text
        or text.count("/") != 1
        or Path(text).suffix.lower() in _LOCAL_BUILDERS
    )
    if local:
        path = _existing_path(text)
        return _load_local(path, split, cache_dir, row_hint), repr(str(path))
    split = split or default_split
    unreachable = _hub_unreachable_reason()
    try:
        with _offline_datasets(unreachable is not None):
            loaded = datasets.load_dataset(text, config_name, split=split, cache_dir=cache_dir)
    except _network_errors() as error:
        message = _download_help(text, split, error, loader)
        if unreachable is not None:
            message += f"\n(The Hub cannot be reached: {unreachable}; only the local cache was searched.)"
        raise DatasetUnavailableError(message) from error
    return _pick_split(loaded, split, repr(text)), repr(text)


def load_math_dataset(
    name: str | os.PathLike[str] | MathDatasetSpec,
    split: str | None = None,
    chat: bool = True,
    instruction: str | None = DEFAULT_INSTRUCTION,
    *,
    system_prompt: str | None = None,
    problem_column: str | None = None,
    answer_column: str | None = None,
    deduplicate: bool | None = None,
    cache_dir: str | None = None,
) -> Dataset:
    """Load a math dataset as ``prompt`` + ``answer`` columns.

    Args:
        name: a short name from :data:`MATH_DATASETS` (``"dapo-math-17k"``, ``"aime-2024"``,
            ``"aime-2025"``, ``"amc"``, ``"beyond-aime"``), its Hub id, another ``owner/name`` Hub id, a
            :class:`MathDatasetSpec`, or a local path: a folder written by ``save_to_disk``, a folder
            downloaded with ``hf download``, or a ``.json``/``.jsonl``/``.parquet``/``.csv`` file. The
            columns of a local or unregistered dataset are matched against the registered layouts.
        split: the split; the registry's default when None. A local single-file dataset has one split,
            which is used whatever its name.
        chat: ``prompt`` as chat messages (True) or plain text (False).
        instruction: appended to each problem after a blank line; None or ``""`` for none. DAPO-Math-17k's
            own "Answer:" template is removed first.
        system_prompt: a system message placed before the user turn (chat only).
        problem_column, answer_column: override the source columns (a dotted path reads a struct field).
        deduplicate: drop repeated (problem, answer) rows; by default only for DAPO-Math-17k, which
            repeats each problem many times.
        cache_dir: passed to ``datasets.load_dataset``.

    Returns:
        A :class:`datasets.Dataset` with columns ``prompt`` and ``answer`` (string).

    Raises:
        DatasetUnavailableError: the Hub could not be reached; the message says how to download it.
        ValueError: an unknown name, or a source column that is missing (named in the message).

    Example:
        >>> train = load_math_dataset("dapo-math-17k")  # doctest: +SKIP
        >>> train[0]["prompt"]  # doctest: +SKIP
        [{'role': 'user', 'content': 'Let $x$ ... \\n\\nPlease reason step by step, and put your final answer within \\\\boxed{}.'}]
        >>> aime = load_math_dataset("./aime_2024", chat=False)  # a folder from `hf download`  # doctest: +SKIP
    """
    import datasets

    spec, path = _resolve(name)
    if path is not None:
        dataset = _load_local(path, split, cache_dir)
        source = repr(str(path))
    else:
        assert spec is not None
        split = split or spec.split
        unreachable = _hub_unreachable_reason()
        try:
            with _offline_datasets(unreachable is not None):
                dataset = datasets.load_dataset(
                    spec.hub_id, spec.config_name, split=split, cache_dir=cache_dir
                )
        except _network_errors() as error:
            message = _download_help(spec.hub_id, split, error)
            if unreachable is not None:
                message += f"\n(The Hub cannot be reached: {unreachable}; only the local cache was searched.)"
            raise DatasetUnavailableError(message) from error
        dataset = _pick_split(dataset, split, repr(spec.hub_id))
        source = repr(spec.hub_id)

    if len(dataset) == 0:
        raise ValueError(f"{source} is empty (split {split!r}); nothing to train or evaluate on.")
    # The layout: the registered one, else detected from the columns (unless both columns are given).
    layout = spec if spec is not None and spec.problem_column else None
    if layout is None and (problem_column is None or answer_column is None):
        layout = _detect_spec(dataset, source)
    problem_column = problem_column or layout.problem_column  # type: ignore[union-attr]
    answer_column = answer_column or layout.answer_column  # type: ignore[union-attr]
    if deduplicate is None:
        deduplicate = layout.deduplicate if layout is not None else False

    for role, column in (("problem_column", problem_column), ("answer_column", answer_column)):
        if not _has_path(dataset, column):
            raise ValueError(
                f"{source} has no column {column!r} ({role}); its columns are {dataset.column_names}. The "
                f"dataset's structure may have changed: pass {role}=... to map it."
            )

    if deduplicate:
        dataset = _deduplicate(dataset, problem_column, answer_column)

    def to_example(row: dict[str, Any]) -> dict[str, Any]:
        problem = _problem_text(_get_path(row, problem_column))
        return {
            "_formatted_prompt": format_prompt(problem, chat, instruction, system_prompt),
            "_formatted_answer": _answer_text(_get_path(row, answer_column)),
        }

    # New column names, then a rename: `map` would otherwise keep the type of a source column of the same
    # name (AMC's float "answer" turns "0.75" back into 0.75).
    formatted = dataset.map(to_example, remove_columns=dataset.column_names, desc="Formatting math prompts")
    return formatted.rename_columns({"_formatted_prompt": "prompt", "_formatted_answer": "answer"})


def prepare_prompt_dataset(
    dataset: Dataset, prompt_column: str = "prompt", answer_column: str | None = "answer"
) -> Dataset:
    """Check a dataset the trainer will sample prompts from, and rename its columns to ``prompt``/``answer``.

    Args:
        dataset: a :class:`datasets.Dataset` (one split, not a ``DatasetDict``).
        prompt_column: the column with prompts: non-empty text or chat messages.
        answer_column: the column with gold answers, or None when the reward functions need none.

    Returns:
        The dataset, with the two columns renamed to ``prompt`` and ``answer`` if they were named otherwise.

    Raises:
        ValueError: a ``DatasetDict``, an empty dataset, a missing column, or a first prompt that is neither
            text nor chat messages; the message names the column.

    Example:
        >>> from datasets import Dataset
        >>> ds = prepare_prompt_dataset(Dataset.from_dict({"question": ["1+1?"], "answer": ["2"]}), "question")
        >>> ds.column_names
        ['prompt', 'answer']
    """
    from datasets import Dataset, DatasetDict, IterableDataset

    if isinstance(dataset, DatasetDict):
        raise ValueError(
            f"got a DatasetDict with splits {sorted(dataset)}; pass one split, e.g. dataset['train']."
        )
    if not isinstance(dataset, (Dataset, IterableDataset)):
        raise ValueError(f"expected a datasets.Dataset, got {type(dataset).__name__}.")
    columns = dataset.column_names
    if columns is not None:
        for role, column in (("prompt_column", prompt_column), ("answer_column", answer_column)):
            if column is not None and column not in columns:
                raise ValueError(
                    f"the dataset has no column {column!r} ({role}); its columns are {columns}. Pass "
                    f"{role}=<the column's name> or rename it."
                )
    if isinstance(dataset, Dataset):
        if len(dataset) == 0:
            raise ValueError(f"the dataset is empty: column {prompt_column!r} has no prompts.")
        first = dataset[0][prompt_column]
        is_text = isinstance(first, str) and first.strip() != ""
        is_chat = (
            isinstance(first, list)
            and len(first) > 0
            and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in first)
        )
        if not (is_text or is_chat):
            raise ValueError(
                f"column {prompt_column!r} must hold non-empty text or chat messages "
                f'[{{"role": ..., "content": ...}}]; its first value is {first!r:.80}.'
            )
    renames = {
        old: new for old, new in ((prompt_column, "prompt"), (answer_column, "answer")) if old and old != new
    }
    for old, new in renames.items():
        if columns is not None and new in columns and new not in renames:
            raise ValueError(
                f"cannot rename column {old!r} to {new!r}: the dataset already has a {new!r} column; drop one."
            )
    return dataset.rename_columns(renames) if renames else dataset
