"""Answers from the cache: one long prompt with a hidden fact, sent cold and then again (greedy).

For every size, a haystack of code-like text with one fact hidden at ``depth`` (a share of the
prompt) and a question at the end is sent twice with ``temperature: 0``, streaming. A unique
marker at the start keeps the first send cold (nothing cached from earlier runs). The two answers
must be identical text (and identical output token counts); both latencies (TTFT and total) and
the cached tokens of the repeat are printed. Whether the answer *finds* the fact is printed too,
but only means something with real weights: the reference engine's random weights never find it.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

import numpy as np
import orjson

from bench.loadgen.client import RequestRecord, stream_message
from bench.loadgen.runner import RunConfig, make_client
from bench.loadgen.textgen import TextSynth


@dataclass(slots=True)
class CacheCheckResult:
    prompt_tokens: int
    cold: RequestRecord
    warm: RequestRecord
    fact: str

    @staticmethod
    def answer(record: RequestRecord) -> str:
        return "".join(b.get("text", "") + b.get("thinking", "") for b in record.blocks)

    @property
    def identical(self) -> bool:
        return (
            self.cold.error is None
            and self.warm.error is None
            and self.answer(self.cold) == self.answer(self.warm)
            and self.cold.output_tokens == self.warm.output_tokens
        )

    @property
    def found_fact(self) -> bool:
        return self.fact in self.answer(self.cold) and self.fact in self.answer(self.warm)

    def row(self) -> str:
        def lat(r: RequestRecord) -> str:
            if r.error:
                return f"error: {r.error[:60]}"
            return f"ttft {r.ttft_s or 0:.2f}s total {r.t_end - r.t_start:.2f}s"

        return (
            f"{self.prompt_tokens:>8} | cold {lat(self.cold):<28} | repeat {lat(self.warm):<28} | "
            f"cached {self.warm.cached_tokens:>7}/{self.warm.total_input_tokens:<7} | "
            f"identical {'yes' if self.identical else 'NO'} | fact found {'yes' if self.found_fact else 'no'}"
        )


def build_prompt(synth: TextSynth, num_tokens: int, depth: float,
                 rng: np.random.Generator) -> tuple[str, str]:
    """(prompt text, fact) of about ``num_tokens`` tokens with the fact at ``depth``."""
    code = f"{int(rng.integers(1000, 9999))}-{int(rng.integers(1000, 9999))}"
    fact = f"\nIMPORTANT: the deployment password of the staging cluster is {code}.\n"
    question = ("\n\nQuestion: what is the deployment password of the staging cluster? Answer with the "
                "password only.")
    body_tokens = max(16, num_tokens - 60)
    before = int(body_tokens * depth)
    text = (
        f"[check {uuid.uuid4().hex}]\n"
        + synth.text(before, rng)
        + fact
        + synth.text(body_tokens - before, rng)
        + question
    )
    return text, code


async def run_cache_check(
    synth: TextSynth,
    config: RunConfig,
    sizes_tokens: list[int],
    depth: float = 0.5,
    max_tokens: int = 32,
) -> list[CacheCheckResult]:
    rng = np.random.default_rng(config.seed + 99)
    results = []
    async with make_client(2) as client:
        for size in sizes_tokens:
            prompt, fact = build_prompt(synth, size, depth, rng)
            session_id = str(uuid.uuid4())
            body = {
                "model": config.model,
                "max_tokens": max_tokens,
                "temperature": 0,
                "stream": True,
                "messages": [{"role": "user", "content": prompt}],
            }
            headers = {
                "Content-Type": "application/json",
                "anthropic-version": "2023-06-01",
                "X-Claude-Code-Session-Id": session_id,
            }
            if config.api_key:
                headers["x-api-key"] = config.api_key
            raw = orjson.dumps(body)
            records = []
            for attempt in range(2):
                rec = RequestRecord(attempt, session_id, 0.0, cold=attempt == 0)
                await stream_message(client, config.url, raw, headers, rec, config.request_timeout_s)
                records.append(rec)
            results.append(CacheCheckResult(size, records[0], records[1], fact))
    return results


def run_cache_check_sync(synth: TextSynth, config: RunConfig, sizes: list[int],
                         depth: float) -> list[CacheCheckResult]:
    return asyncio.run(run_cache_check(synth, config, sizes, depth))
