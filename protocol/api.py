"""The protocol facade the server calls: request bytes -> prompt ids; token ids -> SSE bytes.

Use::

    proto = Protocol(PromptTokenizer.load(model_dir), OutputLedger(), served_model_names,
                     max_model_len)
    prepared = proto.prepare_anthropic(body_bytes, request.headers)   # raises ProtocolError
    stream = proto.new_stream(prepared, request_id)
    yield stream.start(num_cached_tokens)            # message_start / role chunk (streaming)
    for out in engine_outputs:
        data = stream.feed(out.token_ids)            # SSE bytes, may be b""
        if data: yield data
        if stream.stop_hit: abort the engine request; break
    yield stream.finish(reason, num_prompt, num_cached, num_output)  # also records the ledger
    # non-streaming: start()/feed()/finish() return b""; then return stream.response_body()
    # errors after the stream started: yield stream.error(exc)

Every ``prepare_*``/``count_*`` method raises only ``ProtocolError`` subclasses for bad input.
``ResponseStream`` is not thread-safe: one stream is driven by one task.

The ledger: ``ResponseStream.finish`` records the turn's output ids in the ``OutputLedger``
(no call needed from the server; turns cut by a stop sequence or aborted are not recorded).
Anthropic thinking blocks carry the ledger handle as their ``signature``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
import xxhash
from pydantic import BaseModel, ValidationError

from protocol import anthropic_schema as A, openai_schema as O
from protocol.api_types import PreparedRequest, check_tool_choice
from protocol.bound_prompt import BoundPrompt, encode_bound
from protocol.conversation import (
    Conversation,
    anthropic_conversation,
    anthropic_head,
    anthropic_messages,
    openai_conversation,
    openai_head,
    openai_messages,
)
from protocol.depth import check_json_depth
from protocol.detokenize import TokenTable
from protocol.errors import InvalidRequest, ModelNotAvailable, PromptTooLong, ProtocolError, lower_headers
from protocol.history_memo import HistoryMemo, Reuse, build_history, tool_refs
from protocol.ledger import OutputLedger
from protocol.prompt_chunks import ChunkCache
from protocol.render import AssistantSpan, RenderCut, Resume, Segment, ToolsTextCache, render, render_from
from protocol.responses_api import prepare_responses
from protocol.responses_store import ResponseStore
from protocol.sampling import EngineSampling, engine_sampling
from protocol.stream import ResponseStream
from protocol.tokenize import PromptTokenizer, TokenBudgetExceeded

_Req = TypeVar("_Req", bound=BaseModel)

__all__ = ["PreparedRequest", "Protocol", "ResponseStream", "ProtocolError"]

SESSION_HEADER = "x-claude-code-session-id"
# Session key precedence (docs/protocol.md): Claude Code's header, OpenCode's affinity header,
# Codex's session-id header, then the body's prompt_cache_key, metadata.user_id.session_id,
# and last a hash of the conversation head.
SESSION_HEADERS = (SESSION_HEADER, "x-session-affinity", "session-id")
MAX_SESSION_KEY_CHARS = 512
# thinking.display values whose thinking blocks carry no text: "omitted", and "updates" (only
# progress-update blocks carry text there, and V4.1 writes none: all its thinking is reasoning)
HIDDEN_REASONING_DISPLAYS = frozenset({"omitted", "updates"})


def session_hint(headers: Mapping[str, str] | None) -> str | None:
    """The session key a request's headers name, if any (also used before the body is read)."""
    if not headers:
        return None
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value and len(value) <= MAX_SESSION_KEY_CHARS:
            return value
    return None


def _validate(model: type[_Req], data: dict[str, Any]) -> _Req:
    """The wire model for ``data``, or a 400 that names the offending field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest.from_validation(exc) from None


def _validate_rest(model: type[_Req], data: dict[str, Any], start: int) -> _Req | None:
    """The wire model for ``data`` with its messages from ``start`` on (the earlier ones were
    validated in a request before), or None when that is invalid: the whole validation then
    gives the error that names the message by its index in the request."""
    try:
        return model.model_validate(dict(data, messages=data["messages"][start:]))
    except ValidationError:
        return None


def _context(head: Conversation) -> tuple[Any, ...]:
    """What conversion and rendering take from outside the messages (``History.context``)."""
    return (tuple(m.content for m in head.messages), head.tools, head.tool_catalog, head.thinking,
            head.effort, head.response_format)


@dataclass(slots=True)
class _Turn:
    """A request's conversation and what it takes from (and leaves for) the history memo."""

    conv: Conversation
    context: tuple[Any, ...]  # of the conversation before its messages (``_context``)
    key: tuple[str, bytes, str | None]
    raw: list[Any]  # the wire messages
    head: int  # conversation messages before wire message 0
    loaded: list[tuple[int, str]]
    reuse: Reuse | None


def _load_body(body: bytes | dict[str, Any], check_depth: bool = True) -> dict[str, Any]:
    if isinstance(body, dict):
        data = body
    else:
        try:
            data = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidRequest("request body must be a JSON object")
    if check_depth:
        check_json_depth(data)  # 400 here, not RecursionError in render or the ledger
    return data


class Protocol:
    """Holds the tokenizer (with its piece cache), the prompt chunk cache, the token table, the
    ledger and the tool schema text cache."""

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        ledger: OutputLedger,
        served_model_names: Iterable[str],
        max_model_len: int,
        table: TokenTable | None = None,
    ) -> None:
        """``table``: the tokenizer's ``TokenTable`` when the caller already has one (building it
        walks the whole vocabulary, ~0.3 s; the protocol tests share one per session)."""
        self.tokenizer = tokenizer
        self.ledger = ledger
        self.served_model_names = frozenset(served_model_names)
        self.max_model_len = max_model_len
        self.table = table if table is not None else TokenTable(tokenizer.full)
        self.responses_store = ResponseStore()  # previous_response_id / item_reference (bounded)
        self._tools_text = ToolsTextCache()  # tool schema text by tools hash (bounded LRU)
        self.chunks = ChunkCache()  # ids of prompt chunks by their segments (protocol/prompt_chunks.py)
        self.history = HistoryMemo()  # earlier requests' conversions and renders (protocol/history_memo.py)

    # --- requests ----------------------------------------------------------------------------------
    def prepare_anthropic(self, body: bytes | dict[str, Any],
                          headers: Mapping[str, str] | None = None, scope: bytes = b"") -> PreparedRequest:
        """``scope``: the caller's (``server/auth.caller_scope``; b"" where callers cannot be told
        apart); the output ledger serves a turn only to the scope and prefix it was made in."""
        data = _load_body(body, check_depth=False)
        reuse, key = self._find_history("anthropic", data, headers, scope)
        req, turn = self._anthropic_turn(data, reuse, key)
        self.check_model(req.model)
        conv = turn.conv
        bound = self._encode_turn(turn, scope, strict_parts=True)
        tool_choice, tool_name = "auto", None
        if req.tool_choice is not None:
            tool_choice = {"auto": "auto", "any": "required", "tool": "named",
                           "none": "none"}[req.tool_choice.type]
            tool_name = req.tool_choice.name
            check_tool_choice(tool_choice, tool_name,
                              [t["name"] for t in conv.tools] + list(conv.tool_catalog))
        return PreparedRequest.build(
            "anthropic", req.model, req.stream, prompt=bound, conv=conv,
            session_key=self.session_key(headers, conv, req.metadata),
            max_tokens=self.max_tokens_for(len(bound.ids), req.max_tokens),
            sampling=self.engine_sampling(req.temperature, req.top_p, req.top_k, None),
            stop=tuple(req.stop_sequences or ()),
            tool_choice=tool_choice, tool_choice_name=tool_name, include_usage=True,
            show_reasoning=req.thinking is None or req.thinking.display not in HIDDEN_REASONING_DISPLAYS,
            scope=scope,
            # a structured output (output_config.format, read into the conversation; or the
            # older output_format) and no tools: Claude Code's session titles
            one_off=(conv.response_format is not None or bool(data.get("output_format")))
            and not conv.tools and not conv.tool_catalog,
        )

    def prepare_openai(self, body: bytes | dict[str, Any],
                       headers: Mapping[str, str] | None = None, scope: bytes = b"") -> PreparedRequest:
        data = _load_body(body, check_depth=False)
        reuse, key = self._find_history("openai", data, headers, scope)
        req, turn = self._openai_turn(data, reuse, key)
        self.check_model(req.model)
        conv = turn.conv
        bound = self._encode_turn(turn, scope, strict_parts=False)
        requested = req.max_completion_tokens or req.max_tokens
        tool_choice, tool_name = "auto", None
        if isinstance(req.tool_choice, str):
            tool_choice = req.tool_choice
        elif req.tool_choice is not None:
            tool_choice, tool_name = "named", req.tool_choice.function["name"]
        check_tool_choice(tool_choice, tool_name, [t.get("name", "") for t in conv.tools])
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        return PreparedRequest.build(
            "openai", req.model, req.stream, prompt=bound, conv=conv,
            session_key=self.session_key(headers, conv, req.metadata, data.get("prompt_cache_key"), req.user),
            max_tokens=self.max_tokens_for(len(bound.ids), requested), max_tokens_is_default=not requested,
            sampling=self.engine_sampling(req.temperature, req.top_p, req.top_k, req.seed),
            stop=stop, tool_choice=tool_choice, tool_choice_name=tool_name,
            include_usage=bool(req.stream_options and req.stream_options.include_usage) or not req.stream,
            scope=scope,
        )

    def prepare_responses(self, body: bytes | dict[str, Any],
                          headers: Mapping[str, str] | None = None, scope: bytes = b"") -> PreparedRequest:
        """An OpenAI Responses API request (protocol/responses_api.py)."""
        return prepare_responses(self, _load_body(body), headers, scope)

    def count_tokens_anthropic(self, body: bytes | dict[str, Any],
                               headers: Mapping[str, str] | None = None, scope: bytes = b"") -> int:
        """Exact prompt length of an Anthropic count_tokens body (same rendering as a request);
        a prompt no request could send (over ``max_model_len - 1``) is refused like a request."""
        data = _load_body(body)
        req = _validate(A.CountTokensRequest, data)
        self.check_model(req.model)
        conv = anthropic_conversation(req, data.get("tools"))
        return len(self.encode_prompt(conv, scope, strict_parts=True).ids)

    def new_stream(self, prepared: PreparedRequest, request_id: str) -> ResponseStream:
        return ResponseStream(prepared, request_id, self.table, self.ledger)

    # --- the steps every prepare_* takes (protocol/responses_api.py takes them too) ------------------
    def check_model(self, model: str) -> None:
        """Refuse a model name this endpoint does not serve (``ModelNotAvailable``)."""
        if self.served_model_names and model not in self.served_model_names:
            raise ModelNotAvailable(model)

    def encode_prompt(self, conv: Conversation, scope: bytes, *, strict_parts: bool) -> BoundPrompt:
        """The prompt ids, assistant turns from the ledger where it holds them under this scope
        and prefix (protocol/bound_prompt.py); a prompt over ``max_model_len - 1`` tokens is
        refused as soon as that is known (the tokenizer stops there), with an estimate of its
        length. ``strict_parts``: compare text blocks one by one (Anthropic), not joined."""
        spans: list[AssistantSpan] = []
        segments = render(conv, self.table.end_think_id, self.table.eos_id, self._tools_text.text, spans)
        return self._encode_segments(segments, spans, scope, strict_parts)

    def _encode_segments(self, segments: list[Segment], spans: list[AssistantSpan], scope: bytes,
                         strict_parts: bool) -> BoundPrompt:
        limit = self.max_model_len - 1
        try:
            return encode_bound(self.tokenizer, self.ledger, segments, spans, scope, limit, strict_parts,
                                self.table.end_think_id, self.table.eos_id, self.chunks)
        except TokenBudgetExceeded as exc:
            raise PromptTooLong(exc.num_tokens, limit) from None

    # --- incremental preparation (protocol/history_memo.py) ------------------------------------------
    def _find_history(self, api: str, data: dict[str, Any], headers: Mapping[str, str] | None,
                      scope: bytes) -> tuple[Reuse | None, tuple[str, bytes, str | None]]:
        """The kept history this request extends, if any, after the depth check of the rest of
        the body (the messages before the history's cut were checked when it was kept, by this
        caller: they are equal values)."""
        key = (api, scope, session_hint(lower_headers(headers)))
        messages = data.get("messages")
        reuse = self.history.find(key, messages) if isinstance(messages, list) else None
        if reuse is None:
            check_json_depth(data)
        else:
            check_json_depth(dict(data, messages=messages[reuse.wire_index:]))  # type: ignore[index]
        return reuse, key

    def _anthropic_turn(self, data: dict[str, Any], reuse: Reuse | None,
                        key: tuple[str, bytes, str | None]) -> tuple[A.MessagesRequest, _Turn]:
        raw: list[Any] = data["messages"] if isinstance(data.get("messages"), list) else []
        if reuse is not None:
            req = _validate_rest(A.MessagesRequest, data, reuse.wire_index)
            if req is not None:
                conv = anthropic_head(req, data.get("tools"))
                context = _context(conv)
                if context == reuse.history.context:
                    loaded = reuse.loaded()
                    names = dict.fromkeys(name for _, name in loaded)
                    new = anthropic_messages(req.messages, reuse.wire_index, conv.tool_catalog, names)
                    loaded += tool_refs(new, reuse.wire_index, {name for _, name in loaded})
                    head = len(conv.messages)
                    conv.messages = reuse.messages() + new
                    conv.loaded_tools = [name for _, name in loaded]
                    self.history.count(reuse)
                    return req, _Turn(conv, context, key, raw, head, loaded, reuse)
        req = _validate(A.MessagesRequest, data)
        conv = anthropic_conversation(req, data.get("tools"))
        head = len(conv.messages) - len(req.messages)
        context = _context(Conversation(conv.messages[:head], conv.tools, conv.thinking, conv.effort,
                                        conv.response_format, conv.tool_catalog))
        return req, _Turn(conv, context, key, raw, head, tool_refs(conv.messages[head:], 0, set()), None)

    def _openai_turn(self, data: dict[str, Any], reuse: Reuse | None,
                     key: tuple[str, bytes, str | None]) -> tuple[O.ChatCompletionRequest, _Turn]:
        raw: list[Any] = data["messages"] if isinstance(data.get("messages"), list) else []
        if reuse is not None:
            req = _validate_rest(O.ChatCompletionRequest, data, reuse.wire_index)
            if req is not None:
                conv = openai_head(req, data.get("tools"))
                context = _context(conv)
                if context == reuse.history.context:
                    conv.messages = reuse.messages() + openai_messages(req.messages)
                    self.history.count(reuse)
                    return req, _Turn(conv, context, key, raw, 0, [], reuse)
        req = _validate(O.ChatCompletionRequest, data)
        conv = openai_conversation(req, data.get("tools"))
        context = _context(Conversation([], conv.tools, conv.thinking, conv.effort, conv.response_format))
        return req, _Turn(conv, context, key, raw, 0, [], None)

    def _encode_turn(self, turn: _Turn, scope: bytes, *, strict_parts: bool) -> BoundPrompt:
        """``encode_prompt`` of the turn's conversation, rendered from its history's cut where it
        has one; the turn is kept for the next one once its prompt is encoded."""
        conv, reuse = turn.conv, turn.reuse
        cuts: list[RenderCut] = []
        segments: list[Segment] | None = None
        spans: list[AssistantSpan] = []
        if reuse is not None:
            spans = reuse.spans()
            resume = Resume(reuse.segments(), reuse.cut.index, turn.head + reuse.wire_index)
            segments = render_from(resume, conv, self.table.end_think_id, self.table.eos_id,
                                   self._tools_text.text, spans, cuts)
        if segments is None:
            reuse, spans, cuts = None, [], []
            segments = render(conv, self.table.end_think_id, self.table.eos_id, self._tools_text.text, spans,
                              cuts)
        bound = self._encode_segments(segments, spans, scope, strict_parts)
        history = build_history(turn.context, list(turn.raw), conv.messages, turn.head, turn.loaded,
                                segments, spans, cuts, reuse)
        self.history.keep(turn.key, history, reuse.history if reuse is not None else None)
        return bound

    def engine_sampling(self, temperature: float | None, top_p: float | None, top_k: int | None,
                        seed: int | None) -> EngineSampling:
        """The client's sampling values (``None``: not sent) as the engines run them
        (protocol/sampling.py; ``top_k`` at or past the vocabulary is off)."""
        return engine_sampling(temperature, top_p, top_k, seed, self.table.size)

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None) -> int:
        """The output budget: ``requested`` (``None`` or 0: not sent) clamped to the room left in
        ``max_model_len`` after the prompt, at least 1."""
        room = self.max_model_len - num_prompt_tokens
        return max(1, min(requested, room) if requested else room)

    @staticmethod
    def session_key(headers: Mapping[str, str] | None, conv: Conversation, metadata: dict[str, Any] | None,
                    prompt_cache_key: object = None, user: str | None = None) -> str:
        """The session key (docs/protocol.md). OpenAI's ``user`` names an end user, not a
        conversation: it scopes the conversation-head hash, so two users' conversations that
        open alike stay two sessions, while one user's conversations stay apart too."""
        sid = session_hint(lower_headers(headers))
        if sid:
            return sid
        if isinstance(prompt_cache_key, str) and 0 < len(prompt_cache_key) <= MAX_SESSION_KEY_CHARS:
            return prompt_cache_key
        if metadata and isinstance(metadata.get("user_id"), str):
            try:
                uid = orjson.loads(metadata["user_id"])
                uid_session = uid.get("session_id") if isinstance(uid, dict) else None
                if isinstance(uid_session, str) and uid_session:
                    return uid_session
            except orjson.JSONDecodeError:
                pass
        # the conversation head: system text + first user turn (stable across a session's turns)
        hasher = xxhash.xxh3_64()
        if user and len(user) <= MAX_SESSION_KEY_CHARS:
            hasher.update(b"user\0" + user.encode("utf-8", "surrogatepass") + b"\0")
        for m in conv.messages[:3]:
            hasher.update(m.role.encode())
            hasher.update(m.content.encode("utf-8", "surrogatepass"))
            for b in m.blocks or ():
                hasher.update(b.text.encode("utf-8", "surrogatepass"))
            if m.role == "user":
                break
        return "h:" + hasher.hexdigest()

