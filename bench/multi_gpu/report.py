"""The multi-GPU run's markdown report, rendered from its JSON document (``multi_gpu_run.json``)."""

from __future__ import annotations

import math
from typing import Any


def _f(value: Any, spec: str = ".2f", scale: float = 1.0, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return format(float(value) * scale, spec) + unit
    except (TypeError, ValueError):
        return str(value)


def _ms_list(transfers: list[dict[str, Any]]) -> list[tuple[Any, float]]:
    """(blocks, wall ms) per transfer."""
    return [(t["num_blocks"], round(t["wall_s"] * 1e3, 1)) for t in transfers]


def _phase_lines(phases: dict[str, Any]) -> list[str]:
    """The round trips split by phase (``rank/link.py`` ``TransferTiming``), ms p50 / p95 / mean."""
    if not phases:
        return []
    names = [name for name in next(iter(phases.values())) if name != "num"]  # analysis.phase_table's order
    lines = ["", ("Round trips by phase (ms, p50 / p95 / mean): to rank = sent until the rank took it "
                  "off its socket; wait = until the engine call began; engine = allocation, copy and its "
                  "synchronize; back = until the backend read the reply; resume = until the awaiting "
                  "coroutine ran:"), "",
             "| op | n | " + " | ".join(n.removesuffix("_s").replace("_", " ") for n in names) + " |",
             "| --- | --- |" + " --- |" * len(names)]
    for op, t in phases.items():
        cells = [f"{_f(t[n]['p50'], '.2f', 1e3)} / {_f(t[n]['p95'], '.2f', 1e3)} / "
                 f"{_f(t[n]['mean'], '.2f', 1e3)}" for n in names]
        lines.append(f"| {op} | {t['num']} | " + " | ".join(cells) + " |")
    return lines


def _load_row(name: str, s: dict[str, Any] | None) -> str:
    if not s:
        return f"| {name} | - | - | - | - | - | - |"
    return (f"| {name} | {s['num_requests']} ({s['num_errors']} err) | {_f(s['ttft_p50_s'])} / "
            f"{_f(s['ttft_p95_s'])} "
            f"| {_f(s['tok_s_p50'], '.1f')} / {_f(s['tok_s_p10'], '.1f')} | "
            f"{_f(s['cache_hit'], '.1f', 100, '%')} "
            f"| {_f(s['input_tokens_per_s'], ',.0f')} | {_f(s['output_tokens_per_s'], ',.0f')} |")


def _restore_line(name: str, r: dict[str, Any] | None) -> str:
    if not r or not r.get("num"):
        return f"| {name} | 0 | - | - | - | - | - |"
    return (f"| {name} | {r['num']} ({r['num_failed']} failed) | {_f(r['blocks_p50'], '.0f')} / "
            f"{_f(r['blocks_p95'], '.0f')} "
            f"| {_f(r['wall_p50_s'], '.1f', 1e3)} / {_f(r['wall_p95_s'], '.1f', 1e3)} "
            f"| {_f(r['ratio_p50'])} / {_f(r['ratio_p95'])} | {_f(r['effective_gb_s'], '.1f')} "
            f"| {_f(r['limit_gb_s'], '.1f')} |")


def render_markdown(doc: dict[str, Any]) -> str:
    ph = doc.get("phases", {})
    s = doc.get("settings", {})
    lines = [
        f"# Multi-GPU lockstep run ({s.get('ranks')} ranks, {s.get('device')}, reference '{s.get('model')}')",
        ""]
    lines += ["Command:", "", "```", doc.get("command", ""), "```", ""]
    if doc.get("errors"):
        lines += ["**Errors:**", ""] + [f"- {e}" for e in doc["errors"]] + [""]
    m = ph.get("machine", {})
    lines += ["## Machine", "", (f"- python {m.get('python')}, torch {m.get('torch')}, {m.get('cpus')} CPUs, "
               f"/dev/shm free {m.get('dev_shm_free_gib')} GiB, NCCL {m.get('nccl_version', '-')}"),
              f"- multicast off in the driver's environment: {m.get('nvls_env')}"]
    if m.get("gpus"):
        lines += ["", "```", m["gpus"], m.get("topology", ""), "```"]
    st = ph.get("start", {})
    cfg = doc.get("config", {})
    if st:
        lines += ["", "## Start", "",
                  (f"- ready in {_f(st.get('ready_s'), '.1f')} s; {cfg.get('ep')} ranks x "
                   f"{st.get('num_blocks')} blocks "
                   "of 128 tokens "
                   f"({_f(st.get('num_blocks', 0) * doc.get('bytes_per_block', 0) / 2**30, '.2f')} GiB "
                   f"KV per rank, {doc.get('bytes_per_block')} B/block); L1 shared pool "
                   f"{st.get('num_host_slots')} slots "
                   f"= {_f(st.get('l1_gib'), '.2f')} GiB (pinned on CUDA)"),
                  "", "| rank | pid | GPU (bus id, memory) | env seen in /proc/pid/environ |",
                  "| --- | --- | --- | --- |"]
        for r in st.get("ranks", []):
            lines.append(f"| {r['rank']} | {r['pid']} | {r.get('gpu') or '-'} | {r['env']} |")
    cl = ph.get("copy_limit", {})
    if cl:
        lines += ["", "## Pinned-copy limit (same run, before the server started)", "",
                  "| rank GPU | blocks | MB | contiguous ms (GB/s) | import path ms (GB/s) | import / copy |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for rank, v in cl.items():
            for row in v.get("sizes", []):
                lines.append(f"| {rank}: {v.get('device')} ({'pinned' if v.get('pinned') else 'not pinned'}) "
                             f"| {row['blocks']} | {row['bytes'] / 1e6:,.1f} "
                             f"| {row['contiguous_s'] * 1e3:.2f} ({row['contiguous_gb_s']:.1f}) "
                             f"| {row['import_s'] * 1e3:.2f} ({row['import_gb_s']:.1f}) | "
                             f"{row['import_over_copy']:.2f} |")
    ld = ph.get("load", {})
    if ld:
        lines += ["", "## Agent load test", "",
                  f"`{doc.get('load_command', '')}`", "",
                  ("| window | requests | TTFT p50 / p95 s | per-agent tok/s p50 / p10 | cache hit (usage) "
                   "| in tok/s | out tok/s |"),
                  "| --- | --- | --- | --- | --- | --- | --- |",
                  _load_row("steady: after warm-up, before the kill", ld.get("steady")),
                  _load_row("after the group was ready again", ld.get("after_recovery")),
                  _load_row("whole run (warm-up and kill included)", ld.get("whole"))]
        if ld.get("gpu_during_load"):
            lines += ["", "GPUs during the load (index, memory used, utilization):", "", "```",
                      ld["gpu_during_load"], "```"]
    c = ph.get("cache", {})
    if c:
        t = c.get("metrics_delta_whole_load", {})
        lines += ["", "## Cache by tier (/metrics, delta over the load)", "",
                  (f"- prompt tokens admitted {t.get('prompt_tokens', 0):,}: from L0 (GPU) "
                   f"{t.get('l0_tokens', 0):,} "
                   f"= {_f(t.get('hit_l0'), '.1f', 100, '%')}, from L1 (host, restored) "
                   f"{t.get('l1_tokens', 0):,} "
                   f"= {_f(t.get('hit_l1'), '.1f', 100, '%')}, total "
                   f"{_f(t.get('hit_total'), '.1f', 100, '%')}"),
                  ("- the same split counting prefetched restores as L1 (the tier counter files blocks a "
                   "prefetch "
                   "restored before the admission under L0; `l1_restored_tokens_total` counts both): "
                   "resident on "
                   f"the GPU {_f(t.get('hit_resident_corrected'), '.1f', 100, '%')}, restored from L1 "
                   f"{_f(t.get('hit_restored_corrected'), '.1f', 100, '%')}"),
                  (f"- L1 restores inside admissions {t.get('l1_restores')} (mean "
                   f"{_f(t.get('l1_restore_mean_s'), '.1f', 1e3)} ms), "
                   f"restored tokens {t.get('l1_restored_tokens', 0):,}, blocks written to L1 "
                   f"{t.get('l1_written_blocks', 0):,}, evicted blocks {t.get('evicted_blocks', 0):,}, "
                   f"sessions moved {t.get('sessions_moved')}"),
                  (f"- admissions {c.get('num_admissions')} (by rank {c.get('admissions_by_rank')}), with an "
                   "L1 restore "
                   f"{c.get('admissions_with_l1')}; admission queue p50 / p95 "
                   f"{_f((c.get('admission_queue_s_p50_p95') or [None, None])[0])} / "
                   f"{_f((c.get('admission_queue_s_p50_p95') or [None, None])[1])} s"),
                  *([(f"- steady window (warm-up .. kill), from the admissions themselves: "
                      f"{c['steady_admissions']['num']} admissions, L0 "
                      f"{_f(c['steady_admissions']['hit_l0'], '.1f', 100, '%')}, "
                      f"L1 {_f(c['steady_admissions']['hit_l1'], '.1f', 100, '%')} of "
                      f"{c['steady_admissions']['prompt_tokens']:,} prompt tokens")]
                    if c.get("steady_admissions") else []),
                  "",
                  ("L1 transfers as the backend timed them (`RankGroup.import_blocks`/`export_blocks` round "
                   "trip: command, wait for the rank's step boundary, copy, reply) against the contiguous "
                   "pinned-copy time of the same bytes on that rank's GPU:"), "",
                  ("| transfers | n | blocks p50 / p95 | wall ms p50 / p95 | wall / copy limit p50 / p95 "
                   "| effective GB/s | limit GB/s |"),
                  "| --- | --- | --- | --- | --- | --- | --- |",
                  _restore_line("L1 -> GPU restores, whole run", c.get("restores")),
                  _restore_line("L1 -> GPU restores before the kill", c.get("restores_before_kill")),
                  _restore_line("GPU -> L1 writes (vs H2D limit)", c.get("exports")),
                  *_phase_lines(c.get("transfer_phases") or {})]
    mv = ph.get("move")
    if mv:
        lines += ["", "## Cross-GPU session move", ""]
        if "error" in mv:
            lines.append(f"- failed: {mv['error']}")
        else:
            lines.append(f"- session `{mv.get('session')}`: rank {mv.get('src_rank')} -> rank "
                         f"{mv.get('dst_rank')}; "
                         f"move (export to L1) ok={mv.get('move', {}).get('ok')} after "
                         f"{mv.get('move', {}).get('calls')} call(s), "
                         f"{_f(mv.get('move', {}).get('wall_s'), '.1f', 1e3)} ms; exports on the source: "
                         f"{_ms_list(mv.get('move', {}).get('exports_on_src', []))} (blocks, ms)")
            d = mv.get("restored_on_dst", {})
            lines.append(f"- next turn admitted on rank {d.get('admitted_on_rank')}: {d.get('l1_tokens')} "
                         f"tokens restored from L1 in {_f(d.get('restore_s'), '.1f', 1e3)} ms, "
                         f"{d.get('l0_tokens')} from L0; imports on the destination "
                         f"{_ms_list(d.get('imports_on_dst', []))} (blocks, ms); verdict ok={mv.get('ok')}")
            for step in mv.get("steps", []):
                a = step.get("admission") or {}
                lines.append(f"  - {step['what']}: rank {a.get('rank')}, prompt {a.get('prompt')}, L0 "
                             f"{a.get('l0')}, "
                             f"L1 {a.get('l1')}, usage cache_read {step.get('cache_read_input_tokens')}, "
                             f"wall {_f(step.get('wall_s'), '.2f')} s")
    k = ph.get("sigkill")
    if k:
        lines += ["", "## Rank SIGKILL under load", ""]
        if "error" in k:
            lines.append(f"- failed: {k['error']}")
        else:
            ag = k.get("agents", {})
            lines += [
                (f"- killed rank {k.get('victim_rank')} (pid {k.get('victim_pid')}); epoch "
                 f"{k.get('epoch_before')} -> "
                 f"{k.get('epoch_after')}; cause recorded: {k.get('last_failure')}"),
                (f"- detection: group left READY {_f(k.get('group_left_ready_after_s'), '.3f')} s after the "
                 "kill; "
                 "teardown (every in-flight request failed, ranks killed) "
                 f"{_f(k.get('group_teardown_s'), '.3f')} s; "
                 f"agents' in-flight streams: {ag.get('in_flight_at_kill')} in flight, "
                 f"{ag.get('in_flight_failed')} "
                 f"ended with an error {_f(ag.get('first_error_end_after_kill_s'), '.3f')} .. "
                 f"{_f(ag.get('last_error_end_after_kill_s'), '.3f')} s after the kill"),
                (f"- recovery: group READY again {_f(k.get('group_ready_again_after_s'), '.1f')} s after the "
                 "kill; "
                 f"first new request served {_f(k.get('first_new_request_ok_after_s'), '.1f')} s; first "
                 "agent turn "
                 f"completed {_f(ag.get('agent_first_ok_end_after_kill_s'), '.1f')} s; probe answers "
                 f"{k.get('probe_statuses')}"),
                (f"- agent requests started after the kill: {ag.get('requests_started_after_kill')}, of "
                 "which errors "
                 f"{ag.get('errors_started_after_kill')}; error samples: {ag.get('error_samples')}"),
            ]
    return "\n".join(lines) + "\n"
