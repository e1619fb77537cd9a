"""The README documents every config key: its table is generated and must match the model."""

from __future__ import annotations

from pathlib import Path

from server.config import WorkloadConfig, config_table_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_config_table_is_in_sync() -> None:
    text = README.read_text(encoding="utf-8")
    start = text.index("<!-- config-table:start -->\n") + len("<!-- config-table:start -->\n")
    end = text.index("<!-- config-table:end -->")
    assert text[start:end] == config_table_markdown(), (
        "README config table is stale: regenerate it with server.config.config_table_markdown()"
    )


def test_every_config_key_has_a_description() -> None:
    missing = [name for name, field in WorkloadConfig.model_fields.items() if not field.description]
    assert not missing, f"config keys without a description: {missing}"
