"""ready_timeout_secs against the measured load speed; load_timeout_seconds ordering."""

from __future__ import annotations

from pathlib import Path

from server.config import load_config
from server.preflight_checks.model_dir import ModelFacts
from server.preflight_checks.report import Status
from server.preflight_checks.timeouts import check_ready_timeout, check_timeout_order
from tests.preflight.preflight_fakes import deepinfer_config

WEIGHTS = 476 * 10**9  # the seed guide's V4.1-Flash download


def test_default_300_s_with_real_weights_is_fatal(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path, ready_timeout_secs=300)
    res = check_ready_timeout(config, ModelFacts(WEIGHTS, 2.0e9))  # local NVMe: ~238 s just to read
    assert res.status is Status.WARN  # reading fits, init margin does not
    slow = check_ready_timeout(config, ModelFacts(WEIGHTS, 0.3e9))  # network disk: ~26 min
    assert slow.status is Status.FATAL and "kill setup()" in slow.detail
    assert "ready_timeout_secs to at least" in slow.fix


def test_guide_value_is_enough_on_nvme_but_not_on_a_slow_network(tmp_path: Path) -> None:
    config = deepinfer_config(tmp_path, tmp_path)  # ready 5400
    assert check_ready_timeout(config, ModelFacts(WEIGHTS, 2.0e9)).status is Status.OK
    res = check_ready_timeout(config, ModelFacts(WEIGHTS, 0.1e9))  # 4760 s read + margins
    assert res.status is Status.WARN and res.data["estimated_ready_s"] > 5400


def test_unmeasured_short_timeout_warns_for_deepinfer_only(tmp_path: Path) -> None:
    res = check_ready_timeout(deepinfer_config(tmp_path, tmp_path, ready_timeout_secs=300), ModelFacts())
    assert res.status is Status.WARN and "5400" in res.fix
    assert check_ready_timeout(load_config({}), ModelFacts()).status is Status.SKIPPED


def test_timeout_order(tmp_path: Path) -> None:
    bad = deepinfer_config(tmp_path, tmp_path, load_timeout_seconds=3600, ready_timeout_secs=300)
    res = check_timeout_order(bad, ModelFacts())
    assert res.status is Status.WARN and "fires first" in res.detail
    good = deepinfer_config(tmp_path, tmp_path)  # 3600 < 5400
    assert check_timeout_order(good, ModelFacts(WEIGHTS, 2.0e9)).status is Status.OK
    short = deepinfer_config(tmp_path, tmp_path, load_timeout_seconds=600)
    res = check_timeout_order(short, ModelFacts(WEIGHTS, 0.5e9))
    assert res.status is Status.WARN and "below the estimated load time" in res.detail
    # The reference engine loads in seconds: the default 3600 > 300 is not worth a warning.
    assert check_timeout_order(load_config({}), ModelFacts()).status is Status.OK
