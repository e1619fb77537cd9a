"""Reply scripts for the scripted stand-in model (``engine: scripted``).

A script file is one JSON object; it says what the stand-in "model" answers to a prompt, so an
end-to-end scenario (Claude Code, OpenAI SDK) can be written without touching code. The format is
documented in ``docs/claude-code.md``; in short::

    {
      "description": "Read a file, then answer",
      "tokens_per_step": 4,                      # tokens streamed per engine step (default 4)
      "step_delay_s": 0.0,                       # sleep per engine step that emits tokens
      "vars": {"cwd": "Primary working directory: (\\S+)"},
      "replies": [
        {"name": "read", "turn": 1, "match": "What is in README.md",
         "reasoning": "I should read it.",
         "tool_calls": [{"name": "Read", "arguments": {"file_path": "{{cwd}}/README.md"}}]},
        {"name": "answer", "turn": 2, "text": "README.md says: {{readme_line}}"}
      ],
      "default": {"text": "The scripted model has no reply for this prompt."}
    }

Matching is stateless: the reply is a pure function of the prompt, so a retried request (after a
rank restart or a broken stream) gets the same reply. The first reply whose conditions all hold
wins; a reply with no condition always matches.

Conditions (all optional):
  ``turn``          number of ``<｜Assistant｜>`` headers in the prompt (1 = first reply of a
                    conversation; the count restarts after Claude Code compacts).
  ``match``         substring of the *last turn*: the decoded prompt after its last ``<｜User｜>``
                    token (the newest user message, tool results and trailing system messages).
  ``match_regex``   regular expression searched in the last turn.
  ``prompt_match``  substring (or list of substrings, all required) anywhere in the decoded prompt.
  ``not_match``     substring that must NOT be in the last turn.
  ``mode``          ``thinking`` (prompt ends with ``<think>``) or ``chat``.

Templates: ``{{name}}`` in ``reasoning``, ``text``, ``raw`` and any string inside tool
``arguments`` is replaced by a variable. ``vars`` maps a name to a regex with one group, searched in
the whole prompt (first match); or to ``{"regex": ..., "in": "prompt"|"last_turn", "occurrence":
"first"|"last"}``. An unresolved variable becomes ``<unresolved:name>`` (and is logged).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

_TEMPLATE_RE = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


class ScriptError(ValueError):
    """A reply script that cannot be used; the message names the file and the bad field."""


class ToolCall(BaseModel):
    """One DSML invoke: the tool name and its arguments (an object, as the model would emit)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if any(ch in value for ch in '"<>\n'):
            raise ValueError("tool name may not contain quotes, angle brackets or newlines")
        return value


class VarSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    regex: str
    in_: Literal["prompt", "last_turn"] = Field("prompt", alias="in")
    occurrence: Literal["first", "last"] = "first"

    @field_validator("regex")
    @classmethod
    def _one_group(cls, value: str) -> str:
        try:
            compiled = re.compile(value)
        except re.error as exc:
            raise ValueError(f"invalid regex {value!r}: {exc}") from None
        if compiled.groups < 1:
            raise ValueError(f"regex {value!r} needs one capture group")
        return value


class Reply(BaseModel):
    """One scripted model output, with the conditions under which it is chosen."""

    model_config = ConfigDict(extra="forbid")

    name: str = ""
    # Conditions.
    turn: int | None = Field(None, ge=1)
    match: str | None = None
    match_regex: str | None = None
    prompt_match: str | list[str] | None = None
    not_match: str | None = None
    mode: Literal["thinking", "chat"] | None = None
    # Output.
    reasoning: str = ""
    text: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    raw: str | None = Field(
        None, description="Exact output text (added tokens matched); replaces reasoning/text/tools."
    )
    eos: bool = Field(True, description="End with <｜end▁of▁sentence｜> (false: run to max_tokens).")
    # Pacing overrides.
    tokens_per_step: int | None = Field(None, ge=1, le=4096)
    step_delay_s: float | None = Field(None, ge=0, le=60)

    @field_validator("match_regex")
    @classmethod
    def _valid_regex(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"invalid regex {value!r}: {exc}") from None
        return value

    @model_validator(mode="after")
    def _raw_alone(self) -> Reply:
        if self.raw is not None and (self.reasoning or self.text or self.tool_calls):
            raise ValueError("'raw' replaces reasoning/text/tool_calls; do not combine them")
        return self

    def conditions_hold(self, view: PromptView) -> bool:
        if self.turn is not None and view.turn != self.turn:
            return False
        if self.mode is not None and view.mode != self.mode:
            return False
        if self.match is not None and self.match not in view.last_turn:
            return False
        if self.not_match is not None and self.not_match in view.last_turn:
            return False
        if self.match_regex is not None and re.search(self.match_regex, view.last_turn) is None:
            return False
        if self.prompt_match is None:
            return True
        needles = [self.prompt_match] if isinstance(self.prompt_match, str) else self.prompt_match
        return all(n in view.prompt for n in needles)

    def scoped(self, scope: str | None, tokens_per_step: int, step_delay_s: float) -> Reply:
        """This reply as part of an including script: also requires ``scope`` in the prompt and
        keeps its own script's pacing."""
        needles = [] if self.prompt_match is None else (
            [self.prompt_match] if isinstance(self.prompt_match, str) else list(self.prompt_match))
        return self.model_copy(update={
            "prompt_match": ([scope] if scope else []) + needles or None,
            "tokens_per_step": self.tokens_per_step or tokens_per_step,
            "step_delay_s": self.step_delay_s if self.step_delay_s is not None else step_delay_s,
        })


class Script(BaseModel):
    """A whole reply script (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    description: str = ""
    scope: str | None = Field(
        None, min_length=1, description="Substring the prompt must hold for any reply of this script "
        "to match (lets several scenarios share one backend through 'include')."
    )
    include: list[str] = Field(
        default_factory=list, description="Other script files (paths relative to this one) whose "
        "replies follow this script's own, each guarded by its script's scope."
    )
    tokens_per_step: int = Field(4, ge=1, le=4096)
    step_delay_s: float = Field(0.0, ge=0, le=60)
    vars: dict[str, VarSpec] = Field(default_factory=dict)
    replies: list[Reply] = Field(default_factory=list)
    default: Reply = Field(
        default_factory=lambda: Reply(
            name="default", text="The scripted model has no scripted reply for this prompt."
        )
    )
    filler: str = Field(" ok", min_length=1, description="Text repeated after a reply with eos=false.")

    @field_validator("vars", mode="before")
    @classmethod
    def _shorthand_vars(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: ({"regex": v} if isinstance(v, str) else v) for k, v in value.items()}
        return value

    def choose(self, view: PromptView) -> Reply:
        for reply in self.replies:
            if reply.conditions_hold(view):
                return reply
        return self.default

    def resolve_vars(self, view: PromptView) -> dict[str, str]:
        values: dict[str, str] = {}
        for name, spec in self.vars.items():
            haystack = view.prompt if spec.in_ == "prompt" else view.last_turn
            found = list(re.finditer(spec.regex, haystack))
            if found:
                chosen = found[0] if spec.occurrence == "first" else found[-1]
                values[name] = chosen.group(1)
        return values


class PromptView:
    """What reply matching sees of a prompt: the decoded text, its last turn, turn number, mode."""

    __slots__ = ("prompt", "last_turn", "turn", "mode")

    def __init__(self, prompt: str, last_turn: str, turn: int, mode: str) -> None:
        self.prompt = prompt
        self.last_turn = last_turn
        self.turn = turn
        self.mode = mode


def load_script(path: str | Path) -> Script:
    """Read and validate a script file and the files it includes (flattened into one script).

    Raises ScriptError naming the file and the bad field, an include cycle, or a var that two
    scripts define differently.
    """
    return _load(Path(path), ())


def _load(path: Path, stack: tuple[Path, ...]) -> Script:
    path = path.resolve()
    if path in stack:
        raise ScriptError(f"reply script {path} includes itself (via {' -> '.join(map(str, stack))})")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScriptError(f"cannot read reply script {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ScriptError(f"reply script {path} is not valid JSON: {exc}") from None
    try:
        script = Script.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'script'}: {err['msg']}" for err in exc.errors()
        )
        raise ScriptError(f"invalid reply script {path}: {problems}") from None
    replies = [r.scoped(script.scope, script.tokens_per_step, script.step_delay_s) for r in script.replies]
    variables = dict(script.vars)
    for name in script.include:
        child = _load(path.parent / name, (*stack, path))
        for var, spec in child.vars.items():
            if var in variables and variables[var] != spec:
                raise ScriptError(f"reply script {path}: var {var!r} is defined differently in {name}")
            variables[var] = spec
        replies += [r.scoped(script.scope, child.tokens_per_step, child.step_delay_s) for r in child.replies]
    return script.model_copy(update={"replies": replies, "vars": variables, "include": []})


def fill_template(text: str, values: dict[str, str], unresolved: set[str]) -> str:
    def sub(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in values:
            return values[name]
        unresolved.add(name)
        return f"<unresolved:{name}>"

    return _TEMPLATE_RE.sub(sub, text)


def fill_value(value: Any, values: dict[str, str], unresolved: set[str]) -> Any:
    if isinstance(value, str):
        return fill_template(value, values, unresolved)
    if isinstance(value, list):
        return [fill_value(v, values, unresolved) for v in value]
    if isinstance(value, dict):
        return {k: fill_value(v, values, unresolved) for k, v in value.items()}
    return value


def render_dsml(tool_calls: list[ToolCall], values: dict[str, str], unresolved: set[str]) -> str:
    """The V4.1 DSML block (starting with its ``\\n\\n`` separator) for the given calls.

    Strings go out raw with ``string="true"``; anything else as JSON with ``string="false"``,
    written the way the V4.1 encoder writes it (``json.dumps(ensure_ascii=False)``).
    """
    invokes = []
    for call in tool_calls:
        params = []
        for key, value in call.arguments.items():
            value = fill_value(value, values, unresolved)
            if isinstance(value, str):
                body, is_string = value, "true"
            else:
                body, is_string = json.dumps(value, ensure_ascii=False), "false"
            params.append(
                f'<｜DSML｜ parameter name="{key}" string="{is_string}">{body}</｜DSML｜ parameter>'
            )
        inner = "\n".join(params)
        invokes.append(f'<｜DSML｜ invoke name="{call.name}">\n{inner}\n</｜DSML｜ invoke>')
    return "\n\n<｜DSML｜ calls>\n" + "\n".join(invokes) + "\n</｜DSML｜ calls>"


def render_reply(reply: Reply, view: PromptView, values: dict[str, str], unresolved: set[str]) -> str:
    """The reply as V4.1 output text, without the final EOS (the engine appends that id).

    Thinking mode (prompt ends with ``<think>``): ``reasoning</think>text[DSML]``.
    Chat mode: ``text[DSML]`` (reasoning is dropped: chat mode has none).
    """
    if reply.raw is not None:
        return fill_template(reply.raw, values, unresolved)
    out = ""
    if view.mode == "thinking":
        out += fill_template(reply.reasoning, values, unresolved) + "</think>"
    out += fill_template(reply.text, values, unresolved)
    if reply.tool_calls:
        out += render_dsml(reply.tool_calls, values, unresolved)
    return out
