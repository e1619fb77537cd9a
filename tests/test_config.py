import pytest

from server.config import ConfigError, load_config, load_worker_config


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


def test_worker_config_ignores_unknown_keys_with_a_warning() -> None:
    """setup()'s reading: a key the platform adds does not fail a 90-minute deploy."""
    cfg, warnings = load_worker_config({"ep": 2, "ik_workload_id": "w-1", "replicas": 1})
    assert cfg.ep == 2
    assert warnings == ["config key 'ik_workload_id' is not one of this backend's keys; ignored",
                        "config key 'replicas' is not one of this backend's keys; ignored"]
    with pytest.raises(ConfigError, match="unknown config key 'ik_workload_id'"):
        load_config({"ik_workload_id": "w-1"})  # deploy.py, serve --config, preflight: strict


def test_worker_config_still_fails_on_a_misspelt_key() -> None:
    for typo, meant in (("l1_host_gib", "l1_host_gb"), ("max_model_length", "max_model_len"),
                        ("deepinfer_venvs", "deepinfer_venv")):
        with pytest.raises(ConfigError, match=f"unknown config key '{typo}'; did you mean '{meant}'"):
            load_worker_config({typo: 1})
    with pytest.raises(ConfigError, match="config key 'ep'"):
        load_worker_config({"ep": 0, "unrelated_platform_key": 1})
