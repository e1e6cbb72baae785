"""The config reference page (docs/reference/config.md) documents every SAEPPOConfig field that TRL's PPOConfig
lacks, with its default, in the table `trl-sae docs` generates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trl_sae import SAEPPOConfig
from trl_sae.cli.app import main
from trl_sae.cli.docs import CONFIG_PAGE, CONFIG_TABLE_END, CONFIG_TABLE_START, config_fields, config_table
from trl_sae.trainer.trl_base import PPOConfig

PAGE = Path(__file__).resolve().parents[1] / CONFIG_PAGE


def new_fields() -> list[dataclasses.Field]:
    parent = {f.name for f in dataclasses.fields(PPOConfig)}
    return [f for f in dataclasses.fields(SAEPPOConfig) if f.name not in parent]


def page_table_rows() -> dict[str, str]:
    text = PAGE.read_text(encoding="utf-8")
    assert CONFIG_TABLE_START in text and CONFIG_TABLE_END in text, (
        f"{CONFIG_PAGE} lost its config-table markers"
    )
    block = text[text.index(CONFIG_TABLE_START) : text.index(CONFIG_TABLE_END)]
    rows = {}
    for line in block.splitlines():
        if line.startswith("| `"):
            rows[line.split("`")[1]] = line
    return rows


def test_every_new_field_is_in_the_config_page_with_its_default():
    rows = page_table_rows()
    fields = new_fields()
    assert len(fields) >= 15  # sanity: the SAE fields exist
    for f in fields:
        assert f.name in rows, f"{CONFIG_PAGE} does not document SAEPPOConfig.{f.name}"
        default = f.default if f.default is not dataclasses.MISSING else None
        assert f"`{default!r}`" in rows[f.name], f"{CONFIG_PAGE} shows a stale default for {f.name}"


def test_paper_defaults_that_differ_from_ppoconfig_are_listed():
    names = {row["name"] for row in config_fields()}
    assert {"learning_rate", "kl_coef", "temperature", "response_length"} <= names
    assert {f.name for f in new_fields()} <= names


def test_config_page_table_is_the_generated_one(capsys):
    assert main(["docs", "--check", str(PAGE)]) == 0, capsys.readouterr().err
    assert len(config_table().splitlines()) == len(config_fields()) + 2


def test_docs_write_refreshes_a_stale_table(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text(f"intro\n{CONFIG_TABLE_START}\n| old |\n{CONFIG_TABLE_END}\noutro\n")
    assert main(["docs", "--check", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    assert main(["docs", "--write", str(stale)]) == 0
    text = stale.read_text()
    assert (
        text.startswith("intro\n") and text.endswith("outro\n") and "| `segment_threshold` | `0.2` |" in text
    )
    assert main(["docs", "--check", str(stale)]) == 0


def test_docs_without_markers_names_the_markers(tmp_path, capsys):
    page = tmp_path / "config.md"
    page.write_text("# a page with no table\n")
    assert main(["docs", "--write", str(page)]) == 1
    err = capsys.readouterr().err
    assert "has no config-table markers" in err and CONFIG_TABLE_START in err
    assert CONFIG_PAGE in CONFIG_TABLE_START  # the marker says which command regenerates the table


def test_the_readme_no_longer_holds_the_table():
    # One generated table, on the docs page; a second copy in the README could go stale unchecked.
    readme = (PAGE.parents[2] / "README.md").read_text(encoding="utf-8")
    assert "trl-sae config table" not in readme and "| `segment_threshold` |" not in readme
