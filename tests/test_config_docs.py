"""README.md documents every SAEPPOConfig field that TRL's PPOConfig lacks, with its default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trl.experimental.ppo import PPOConfig

from trl_sae import SAEPPOConfig
from trl_sae.cli.app import main
from trl_sae.cli.docs import README_TABLE_END, README_TABLE_START, config_fields, config_table

README = Path(__file__).resolve().parents[1] / "README.md"


def new_fields() -> list[dataclasses.Field]:
    parent = {f.name for f in dataclasses.fields(PPOConfig)}
    return [f for f in dataclasses.fields(SAEPPOConfig) if f.name not in parent]


def readme_table_rows() -> dict[str, str]:
    text = README.read_text(encoding="utf-8")
    assert README_TABLE_START in text and README_TABLE_END in text, "README lost its config-table markers"
    block = text[text.index(README_TABLE_START) : text.index(README_TABLE_END)]
    rows = {}
    for line in block.splitlines():
        if line.startswith("| `"):
            rows[line.split("`")[1]] = line
    return rows


def test_every_new_field_is_in_the_readme_with_its_default():
    rows = readme_table_rows()
    fields = new_fields()
    assert len(fields) >= 15  # sanity: the SAE fields exist
    for f in fields:
        assert f.name in rows, f"README.md does not document SAEPPOConfig.{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else None
        assert f"`{default!r}`" in rows[f.name], f"README.md shows a stale default for {f.name}"


def test_paper_defaults_that_differ_from_ppoconfig_are_listed():
    names = {row["name"] for row in config_fields()}
    assert {"learning_rate", "kl_coef", "temperature", "response_length"} <= names
    assert {f.name for f in new_fields()} <= names


def test_readme_table_is_the_generated_one(capsys):
    assert main(["docs", "--check", str(README)]) == 0, capsys.readouterr().err
    assert len(config_table().splitlines()) == len(config_fields()) + 2


def test_docs_write_refreshes_a_stale_table(tmp_path, capsys):
    stale = tmp_path / "README.md"
    stale.write_text(f"intro\n{README_TABLE_START}\n| old |\n{README_TABLE_END}\noutro\n")
    assert main(["docs", "--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(["docs", "--write", str(stale)]) == 0
    text = stale.read_text()
    assert (
        text.startswith("intro\n") and text.endswith("outro\n") and "| `segment_threshold` | `0.2` |" in text
    )
    assert main(["docs", "--check", str(stale)]) == 0
