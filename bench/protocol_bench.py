"""Protocol benchmark (not a test): prompt preparation on a 500K-token session, parser throughput.

Run: ``python -m bench.protocol_bench [--tokens 500000] [--repeats 7]``; ``--quick``: a 100K-token
session under a 262,144-token limit (fewer than its characters, so the budget checks run as they
do for a 474K session under 1M), 3 repeats, no whole-prompt tokenization, a short stream (seconds;
the default suite and the perf guard)

Prints
1. CPU ms from a parsed Anthropic request (a dict) to prompt ids for a Claude-Code-like session
   of ~N tokens whose newest turn adds ~2K tokens, every check included, and from its body bytes
   (orjson parse first), median over repeats, with the piece cache, the prompt chunk cache and
   the kept history warm from the previous turn (what a real session sees), next to
2. the naive cost: tokenizing the whole prompt text in the same run, and
3. parse + emit throughput (detokenizer, streaming parser, Anthropic, OpenAI chat and OpenAI
   Responses emitters) in tokens/s on one core, feeding one token per call (the worst case: one
   engine step each), for a reasoning + text + small call output and for an output that is
   mostly one streamed tool argument (a ~300-line Write).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import orjson

from protocol import anthropic_schema as A
from protocol.api import Protocol
from protocol.ledger import OutputLedger
from protocol.render import render, segments_text
from protocol.tokenize import PromptTokenizer

D = "｜DSML｜"
EOS = "<｜end▁of▁sentence｜>"
MODEL = "deepseek-v4.1-flash"


def _code_text(rng: random.Random, num_chars: int) -> str:
    words = ["def", "return", "self", "value", "import", "class", "for", "in", "if", "else", "None", "True",
             "result", "config", "path", "os", "np", "array", "tokens", "=", "(", ")", ":", "+", "1", "42"]
    lines = []
    n = 0
    k = 0
    while n < num_chars:
        k += 1
        line = f"{k:>6}\t" + "    " * rng.randint(0,
                                                  3) + " ".join(rng.choice(words)
                                                                for _ in range(rng.randint(3, 12)))
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)


def build_session(target_tokens: int, seed: int = 0) -> tuple[dict[str, Any], int]:
    """A Claude-Code-shaped body: system blocks, 24 tools, a long chain of Read tool rounds."""
    rng = random.Random(seed)
    tools = [
        {"name": f"Tool{k}", "description": "Does a thing. " * 40,
         "input_schema": {"type": "object",
                          "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}}}}
        for k in range(23)
    ] + [{"name": "Read", "description": "Read a file.",
          "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}]
    messages: list[dict[str, Any]] = [
        {"role": "user",
         "content": [{"type": "text",
                      "text": "<system-reminder>\nToday's date is 2026-11-29.\n</system-reminder>\n\n"},
                                     {"type": "text", "text": "Refactor the tokenizer module."}]},
        {"role": "system", "content": "Agents: general-purpose.\n" * 100},
    ]
    approx_tokens = 20_000
    turn = 0
    while approx_tokens < target_tokens:
        turn += 1
        result = _code_text(rng, 7_500)  # ~2K tokens of code per tool result
        messages.append({"role": "assistant", "content": [
            {"type": "thinking",
             "thinking": f"Step {turn}: read the next file and check the call sites. " * 3, "signature": "x"},
            {"type": "text", "text": f"Reading part {turn}."},
            {"type": "tool_use", "id": f"toolu_{turn:024d}", "name": "Read",
             "input": {"file_path": f"/src/mod_{turn}.py"}},
        ]})
        messages.append({"role": "user",
                         "content": [{"type": "tool_result", "tool_use_id": f"toolu_{turn:024d}",
                                      "content": result}]})
        approx_tokens += 2_100
    body = {
        "model": MODEL, "max_tokens": 32000, "stream": True, "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197.a5a;"},
                   {"type": "text", "text": "You are a Claude agent. " + "Main prompt text. " * 300}],
        "tools": tools, "messages": messages,
    }
    return body, turn


def bench_prepare(proto: Protocol, body: dict[str, Any], repeats: int) -> dict[str, float]:
    """Time turn N with the caches warm from turn N-1 only (the tokenizer's pieces, the prompt
    chunks, the kept history): ``prepare_anthropic`` on the parsed body (every check it makes
    included), and orjson's parse before it; a whole pydantic validation of the body is timed
    apart, for reference (``prepare_anthropic`` validates only the messages it has not seen)."""
    prev = dict(body, messages=body["messages"][:-2])
    raw = orjson.dumps(body)
    parse_ms, validate_ms, prep_ms, total_ms = [], [], [], []
    n_tokens = 0
    for _ in range(repeats):
        proto.tokenizer.cache.clear()
        proto.chunks.clear()
        proto.history.clear()  # all warm from turn N-1 only, never from turn N itself
        proto.prepare_anthropic(prev, {})
        t0 = time.process_time()
        data = orjson.loads(raw)
        t1 = time.process_time()
        p = proto.prepare_anthropic(data, {})
        t2 = time.process_time()
        A.MessagesRequest.model_validate(orjson.loads(raw))
        t3 = time.process_time()
        n_tokens = p.num_prompt_tokens
        parse_ms.append((t1 - t0) * 1e3)
        prep_ms.append((t2 - t1) * 1e3)
        total_ms.append((t2 - t0) * 1e3)
        validate_ms.append((t3 - t2) * 1e3 - parse_ms[-1])
    return {
        "prompt_tokens": n_tokens,
        "json_parse_ms": statistics.median(parse_ms),
        "validate_ms": statistics.median(validate_ms),
        "parsed_to_ids_ms": statistics.median(prep_ms),
        "bytes_to_ids_ms": statistics.median(total_ms),
    }


def bench_whole(proto: Protocol, body: dict[str, Any], repeats: int) -> tuple[float, float]:
    req = A.MessagesRequest.model_validate(body)
    from protocol.conversation import anthropic_conversation

    conv = anthropic_conversation(req, body["tools"])
    segments = render(conv)
    text = segments_text(segments)
    naive, cold = [], []
    for _ in range(max(1, repeats // 2)):
        t0 = time.process_time()
        proto.tokenizer.encode_text(text)
        t1 = time.process_time()
        proto.tokenizer.encode_segments(segments, use_cache=False)
        t2 = time.process_time()
        naive.append((t1 - t0) * 1e3)
        cold.append((t2 - t1) * 1e3)
    return statistics.median(naive), statistics.median(cold)


def stream_outputs() -> dict[str, str]:
    unit = ("Let me look at the call sites of encode_segments and check how the cache is keyed. "
            "The piece cache is shared by sessions, so identical system prompts hit. ") * 4
    mixed = (unit * 3 + "</think>" + "I will now update the module and run the tests. " * 10 +
             f"\n\n<{D} calls>\n<{D} invoke name=\"Read\">\n<{D} parameter name=\"file_path\" "
             f"string=\"true\">/src/a.py</{D} parameter>\n</{D} invoke>\n</{D} calls>{EOS}")
    code = _code_text(random.Random(1), 12_000)  # ~300 lines
    write = (f"I will write the module.</think>\n\n<{D} calls>\n<{D} invoke name=\"Read\">\n"
             f"<{D} parameter name=\"file_path\" string=\"true\">/src/a.py</{D} parameter>\n"
             f"<{D} parameter name=\"content\" string=\"true\">{code}</{D} parameter>\n</{D} invoke>\n</{D} "
             f"calls>{EOS}")
    return {"mixed": mixed, "write": write}


def bench_stream(proto: Protocol, num_tokens: int, out: str) -> dict[str, float]:
    tok = proto.tokenizer
    ids = tok.encode_text(out).tolist()
    reps = max(1, num_tokens // len(ids))
    results = {}
    for api in ("anthropic", "openai", "responses"):
        if api == "responses":
            p = proto.prepare_responses({"model": MODEL, "stream": True, "store": False, "input": "x",
                                         "include": ["reasoning.encrypted_content"],
                                         "tools": [{"type": "function", "name": "Read",
                                                    "parameters": {"type": "object"}}]}, {})
        elif api == "anthropic":
            p = proto.prepare_anthropic({"model": MODEL, "max_tokens": 100, "stream": True,
                                         "thinking": {"type": "adaptive"},
                                         "tools": [{"name": "Read", "input_schema": {"type": "object"}}],
                                         "messages": [{"role": "user", "content": "x"}]}, {})
        else:
            p = proto.prepare_openai({"model": MODEL, "stream": True,
                                      "messages": [{"role": "user", "content": "x"}],
                                      "tools": [{"type": "function",
                                                 "function": {"name": "Read",
                                                              "parameters": {"type": "object"}}}]}, {})
        total = 0
        nbytes = 0
        t0 = time.process_time()
        for r in range(reps):
            s = proto.new_stream(p, f"r{r}")
            nbytes += len(s.start(0))
            for t in ids:
                nbytes += len(s.feed([t]))
            nbytes += len(s.finish("stop", p.num_prompt_tokens, 0, len(ids)))
            total += len(ids)
        dt = time.process_time() - t0
        results[api] = total / dt
        results[api + "_bytes_per_token"] = nbytes / total
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=500_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--stream-tokens", type=int, default=200_000)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: 100K tokens, 3 repeats, no naive")
    args = ap.parse_args(argv)
    max_model_len = 1_064_960
    if args.quick:  # a context limit below the body's characters, as a 474K session's is below 1M
        args.tokens, args.repeats, args.stream_tokens, max_model_len = 100_000, 3, 2_000, 262_144
    tok = PromptTokenizer.load()
    proto = Protocol(tok, OutputLedger(), [MODEL], max_model_len)
    body, turns = build_session(args.tokens)
    res = bench_prepare(proto, body, args.repeats)
    naive_ms, cold_ms = (float("nan"), float("nan")) if args.quick else bench_whole(proto, body, args.repeats)
    print(f"session: {res['prompt_tokens']:,} prompt tokens, {turns} tool rounds, newest turn ~2K tokens, "
          f"{len(orjson.dumps(body)):,} body bytes")
    print("  parsed request -> prompt ids (validate the new messages, convert+render+tokenize, warm caches): "
          f"{res['parsed_to_ids_ms']:.1f} ms median")
    print(f"  + orjson parse {res['json_parse_ms']:.1f} ms -> body bytes to ids "
          f"{res['bytes_to_ids_ms']:.1f} ms (a whole pydantic validation of the body: "
          f"{res['validate_ms']:.1f} ms, not part of it)")
    print(f"  whole prompt tokenized at once (naive, added-token matching): {naive_ms:.0f} ms")
    print(f"  whole prompt tokenized segment-wise, cache off (cold first turn): {cold_ms:.0f} ms")
    for name, out in stream_outputs().items():
        st = bench_stream(proto, args.stream_tokens, out)
        label = "reasoning+text+call" if name == "mixed" else "300-line Write argument"
        print(f"parse+emit, one token per feed, one core, {label}: "
              + ", ".join(f"{api} {st[api]:,.0f} tok/s ({st[api + '_bytes_per_token']:.0f} SSE bytes/token)"
                          for api in ("anthropic", "openai", "responses")))


if __name__ == "__main__":
    main()
