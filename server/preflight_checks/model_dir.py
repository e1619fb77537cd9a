"""Model directory checks: the files DeepInfer loads, where they live, and how fast they read.

DeepInfer mmaps the weights: from a network filesystem the seed deployment's load took about
13 minutes or stalled, from local NVMe about 4 minutes (seed guide, "Weights on local disk").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from server.preflight_checks.context import GIB, MIB, human_bytes, is_deepinfer
from server.preflight_checks.probe import SystemProbe
from server.preflight_checks.report import CheckResult, ok, problem, skipped, warn

if TYPE_CHECKING:
    from server.config import WorkloadConfig

LOCAL_FS_TYPES = frozenset({
    "ext2", "ext3", "ext4", "ext2/ext3", "xfs", "btrfs", "overlay", "overlayfs", "tmpfs", "ramfs",
    "zfs", "f2fs", "bcachefs", "jfs", "reiserfs",
})
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb", "smb2", "smb3", "smbfs", "ceph", "cephfs", "glusterfs", "lustre",
    "gpfs", "beegfs", "9p", "afs", "wekafs", "juicefs", "s3fs", "gcsfuse", "virtiofs",
})
SLOW_READ_BYTES_PER_S = 1.0e9  # below this a 476 GB load needs more than 8 minutes of reading
MIN_JUDGED_SAMPLE_BYTES = 32 * MIB  # smaller samples are dominated by noise; report, do not judge


@dataclass(slots=True, frozen=True)
class ModelFacts:
    """What the model checks measured, for the timeout checks."""

    weights_bytes: int | None = None
    read_bytes_per_s: float | None = None


def classify_fs(fstype: str | None) -> str:
    """'local', 'network' or 'unknown'. Every FUSE filesystem counts as network-like (userspace I/O)."""
    if not fstype:
        return "unknown"
    t = fstype.lower()
    if t in LOCAL_FS_TYPES:
        return "local"
    if t in NETWORK_FS_TYPES or t.startswith(("fuse", "nfs")):
        return "network"
    return "unknown"


def _shards(model_dir: Path) -> list[Path]:
    return sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())


def _indexed_missing(model_dir: Path) -> tuple[int, list[str]] | None:
    """Shards named by ``model.safetensors.index.json`` that are absent (an incomplete download)."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_bytes()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
    except (json.JSONDecodeError, AttributeError, TypeError):
        return 0, ["model.safetensors.index.json (unreadable)"]
    return len(names), [n for n in names if not (model_dir / n).is_file()]


def check_model_files(config: WorkloadConfig, model_dir: Path | None) -> tuple[CheckResult, ModelFacts]:
    name = "model_dir"
    deepinfer = is_deepinfer(config)
    if model_dir is None:
        if deepinfer:
            return problem(
                name, True, "no model directory configured",
                "Set env.DEEPINFER_HF_MODEL_DIR (or model_dir) to the local HF directory of the weights.",
            ), ModelFacts()
        return skipped(name,
                       f"no model_dir; engine '{config.engine}' uses the bundled tokenizer"), ModelFacts()
    if not model_dir.is_dir():
        return problem(
            name, deepinfer, f"{model_dir} does not exist or is not a directory",
            "Download the weights to local disk (seed guide step 1) and point DEEPINFER_HF_MODEL_DIR at "
            "them.",
        ), ModelFacts()
    missing = [f
               for f in ("config.json", "tokenizer.json", "tokenizer_config.json")
               if not (model_dir / f).is_file()]
    if (model_dir / "config.json").is_file():
        try:
            json.loads((model_dir / "config.json").read_bytes())
        except json.JSONDecodeError:
            missing.append("config.json (not valid JSON)")
    shards = _shards(model_dir)
    weights_bytes = sum(p.stat().st_size for p in shards)
    facts = ModelFacts(weights_bytes=weights_bytes or None)
    data = {"path": str(model_dir), "num_shards": len(shards), "weights_bytes": weights_bytes}
    indexed = _indexed_missing(model_dir)
    if indexed is not None and indexed[1]:
        missing.append(f"{len(indexed[1])} of {indexed[0]} indexed shards, e.g. {indexed[1][0]}")
    if deepinfer and not shards:
        missing.append("*.safetensors weight shards")
    if missing:
        return problem(
            name, deepinfer, f"{model_dir} lacks {', '.join(missing)}",
            "Finish the download of deepseek-ai/DeepSeek-V4.1-Flash-1017 into this directory "
            "(snapshot_download resumes where it stopped).", **data,
        ), facts
    return ok(name,
              f"{model_dir}: config, tokenizer and {len(shards)} shard(s), {human_bytes(weights_bytes)}",
              **data), facts


def check_model_filesystem(config: WorkloadConfig, model_dir: Path | None, probe: SystemProbe) -> CheckResult:
    name = "model_fs"
    if model_dir is None or not model_dir.is_dir():
        return skipped(name, "no model directory to inspect")
    fstype = probe.filesystem_type(model_dir)
    kind = classify_fs(fstype)
    data = {"fstype": fstype, "kind": kind}
    if kind == "local":
        return ok(name, f"{model_dir} is on {fstype} (local)", **data)
    fix = ("Put the weights on local disk (a large container disk, no network volume) and download "
           "them again; DeepInfer mmaps them and a network load takes 13+ minutes or stalls.")
    if kind == "network":
        return warn(name, f"{model_dir} is on {fstype}, a network/FUSE filesystem", fix, **data)
    return warn(name, f"{model_dir} is on '{fstype or 'unknown'}', not a known local filesystem", fix, **data)


def check_read_speed(
    config: WorkloadConfig, model_dir: Path | None, probe: SystemProbe, *,
    sample_bytes: int = 256 * MIB, max_seconds: float = 3.0,
) -> tuple[CheckResult, float | None]:
    """Time a bounded sequential read from the middle of the largest shard (page cache dropped)."""
    name = "model_read_speed"
    shards = _shards(model_dir) if model_dir is not None and model_dir.is_dir() else []
    if not shards or sample_bytes <= 0:
        return skipped(name, "no weight shard to sample" if sample_bytes > 0 else "disabled"), None
    shard = max(shards, key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    offset = max(0, min(size // 2, size - sample_bytes)) // MIB * MIB
    try:
        sample = probe.read_sample(shard, offset, sample_bytes, max_seconds)
    except OSError as exc:
        return problem(
            name, is_deepinfer(config), f"cannot read {shard.name}: {exc}",
            "Make the weight files readable by the worker's user.",
        ), None
    speed = sample.bytes_per_s
    data = {"shard": shard.name, "sample_bytes": sample.num_bytes, "elapsed_s": sample.elapsed_s,
            "bytes_per_s": speed, "cache_dropped": sample.cache_dropped}
    if speed is None:
        return skipped(name, f"read 0 bytes from {shard.name}", **data), None
    cached = "" if sample.cache_dropped else " (page cache not dropped: may be optimistic)"
    text = (f"{speed / 1e6:,.0f} MB/s sequential, {sample.num_bytes / MIB:.0f} MiB of {shard.name} in "
            f"{sample.elapsed_s:.2f} s{cached}")
    if sample.num_bytes < MIN_JUDGED_SAMPLE_BYTES:
        return ok(name, text + "; sample too small to judge the disk", **data), speed
    if speed < SLOW_READ_BYTES_PER_S:
        total = sum(p.stat().st_size for p in shards)
        return warn(
            name,
            text + f"; reading {total / GIB:.0f} GiB of weights takes about {total / speed / 60:.0f} min",
            "Move the weights to local NVMe (about 2 GB/s or more per stream) and raise ready_timeout_secs "
            "to cover the load meanwhile.", **data,
        ), speed
    return ok(name, text, **data), speed
