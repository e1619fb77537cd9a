"""The persistent tier's directory (``l2_dir``): local disk, room for ``l2_gb``, and its speed.

L2 restores a session's KV from disk instead of recomputing it, which pays only when the disk
is fast and local: on a network or FUSE filesystem reads are slow and ``O_DIRECT`` semantics
vary, and on tmpfs the "disk" is the same RAM the L1 pool needs and is gone after a reboot. The
speed is measured the way L2 moves bytes (``cache.l2_io``: one stream of 16 MiB direct I/O
writes, then reads of the same file), in ``l2_dir`` itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from server.preflight_checks.context import GIB, MIB, gib
from server.preflight_checks.model_dir import MIN_JUDGED_SAMPLE_BYTES, classify_fs
from server.preflight_checks.probe import SystemProbe
from server.preflight_checks.report import CheckResult, ok, skipped, warn

if TYPE_CHECKING:
    from server.config import WorkloadConfig

PROTOCOL_STATE_BYTES = 768 * MIB  # the ledger and piece logs (server/persist.py bounds)
SLOW_L2_READ_BYTES_PER_S = 1.0e9  # a 1M-token V4.1 session (~0.9 GB) then restores in over a second
RAM_FS_TYPES = frozenset({"tmpfs", "ramfs"})


def check_l2_dir(config: WorkloadConfig, probe: SystemProbe, *, sample_bytes: int = 256 * MIB,
                 max_seconds: float = 3.0) -> CheckResult:
    name = "l2_dir"
    if not config.l2_dir:
        return skipped(name, "l2_dir not set: no KV on disk, ledger and tokenization cache in memory only")
    path = Path(config.l2_dir)
    want = int(config.l2_gb * GIB) + PROTOCOL_STATE_BYTES
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return warn(name, f"cannot create {path}: {exc.strerror or exc}",
                    "Create l2_dir on local NVMe, writable by the worker's user; until then nothing "
                    "persists.",
                    path=str(path))
    fstype = probe.filesystem_type(path)
    kind = classify_fs(fstype)
    free = probe.disk_free_bytes(path)
    data: dict[str, object] = {"path": str(path), "fstype": fstype, "kind": kind, "free_bytes": free,
                               "wanted_bytes": want}
    parts = [f"{path} on {fstype or 'unknown'} ({kind})"]
    fixes = []
    if kind == "network":
        fixes.append("Put l2_dir on local NVMe, not a network/FUSE filesystem.")
    elif (fstype or "").lower() in RAM_FS_TYPES:
        fixes.append("Put l2_dir on local disk: on tmpfs it takes the RAM L1 needs and is lost on reboot.")
    elif kind == "unknown":
        fixes.append("Check that l2_dir is on local disk (ext4, xfs, overlay).")
    if free is not None:
        parts.append(f"{gib(free)} free for l2_gb {config.l2_gb:g} + "
                     f"{PROTOCOL_STATE_BYTES // MIB} MiB of protocol state")
        if free < want:
            fits = max(0.0, (free - PROTOCOL_STATE_BYTES) / GIB)
            fixes.append(f"Free disk space or lower l2_gb to {fits:.0f}: L2 holds itself to what the disk "
                         "has free.")
    if config.l2_gb <= 0:
        fixes.append("Set l2_gb to keep KV on disk: with l2_gb 0 only the ledger and tokenization cache "
                     "persist, so a restart (a redeploy, an exit on a rank group failure) starts every "
                     "session cold.")
    if sample_bytes > 0 and config.l2_gb > 0:
        try:
            speed = probe.disk_speed(path, sample_bytes, max_seconds)
        except OSError as exc:
            fixes.append(f"Make {path} writable by the worker (the speed test failed: "
                         f"{exc.strerror or exc}).")
        else:
            data.update(read_bytes_per_s=speed.read_bytes_per_s, write_bytes_per_s=speed.write_bytes_per_s,
                        sample_bytes=speed.read_bytes, direct_io=speed.is_direct)
            io = "direct I/O" if speed.is_direct else "buffered I/O (no O_DIRECT here)"
            parts.append(f"{io} read {speed.read_bytes_per_s / 1e9:.2f} GB/s, write "
                         f"{speed.write_bytes_per_s / 1e9:.2f} GB/s ({speed.read_bytes // MIB} MiB)")
            judged = speed.read_bytes >= MIN_JUDGED_SAMPLE_BYTES
            if judged and speed.read_bytes_per_s < SLOW_L2_READ_BYTES_PER_S:
                fixes.append("Use local NVMe for l2_dir: below 1 GB/s a long session restores slower than "
                             "the GPUs could recompute much of it.")
    detail = "; ".join(parts)
    if fixes:
        return warn(name, detail, " ".join(fixes), **data)
    return ok(name, detail, **data)
