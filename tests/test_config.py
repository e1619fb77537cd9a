import pytest

from server.config import ConfigError, load_config


def test_config_defaults_are_valid() -> None:
    cfg = load_config({})
    assert cfg.engine == "reference"
    assert cfg.served_model_names == {"deepinfer-v41-flash", "deepseek-v4.1-flash", "default"}


def test_config_unknown_key_names_key_and_allowed_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"epp": 4})
    assert "unknown config key 'epp'" in str(info.value)
    assert "max_num_seqs" in str(info.value)


def test_config_bad_value_names_key() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"ep": 0})
    assert "config key 'ep'" in str(info.value)


def test_config_deepinfer_needs_venv() -> None:
    with pytest.raises(ConfigError, match="deepinfer_venv"):
        load_config({"engine": "deepinfer"})
