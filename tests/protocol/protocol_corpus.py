"""Tricky model outputs and the events each must produce (used by test_protocol_parser.py).

``out`` is a list of parts: a str is encoded the way the model emits it (special-token strings
become their control ids); ``("plain", s)`` is encoded without added-token matching (text that
merely looks like a tag). Expected events: ("r", text) reasoning, ("t", text) content,
("call", name, args). Adjacent deltas of one kind are merged before comparing.
"""

from __future__ import annotations

D = "｜DSML｜"
E = "<｜end▁of▁sentence｜>"
TOOLS = {
    "Read": frozenset({"file_path", "offset", "limit"}),
    "Bash": frozenset({"command", "timeout"}),
    "Wrap": frozenset({"input", "x"}),
}


def block(*invokes: str, v4: bool = False) -> str:
    if v4:
        return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"
    return f"\n\n<{D} calls>\n" + "\n".join(invokes) + f"\n</{D} calls>"


def inv(name: str, *params: str, v4: bool = False) -> str:
    sp = "" if v4 else " "
    body = "\n".join(params)
    return f'<{D}{sp}invoke name="{name}">\n{body}\n</{D}{sp}invoke>'


def par(key: str, value: str, string: str | None = "true", close: bool = True, v4: bool = False) -> str:
    sp = "" if v4 else " "
    attr = f' string="{string}"' if string is not None else ""
    return f'<{D}{sp}parameter name="{key}"{attr}>{value}' + (f"</{D}{sp}parameter>" if close else "")


READ = inv("Read", par("file_path", "/p/README.md"))

CASES: list[dict] = [
    dict(name="reasoning_then_text", thinking=True, out=["I should greet.</think>Hello world!", E],
         events=[("r", "I should greet."), ("t", "Hello world!")]),
    dict(name="chat_text", thinking=False, out=["Hello", E], events=[("t", "Hello")]),
    dict(name="single_call", thinking=True, out=["Read it.</think>" + block(READ), E],
         events=[("r", "Read it."), ("call", "Read", {"file_path": "/p/README.md"})]),
    dict(name="text_then_call", thinking=True, out=["R</think>I'll read it." + block(READ), E],
         events=[("r", "R"), ("t", "I'll read it."), ("call", "Read", {"file_path": "/p/README.md"})]),
    dict(name="parallel_calls", thinking=True,
         out=["R</think>"
              + block(READ, inv("Bash", par("command", "ls -la"), par("timeout", "5000", "false"))), E],
         events=[("r", "R"), ("call", "Read", {"file_path": "/p/README.md"}),
                 ("call", "Bash", {"command": "ls -la", "timeout": 5000})]),
    dict(name="json_values", thinking=False,
         out=[block(inv("Read", par("offset", "10", "false"), par("limit", "null", "false"),
                        par("file_path", '{"a": [1, 2.5, true], "b": {"c": null}}', "false"))), E],
         events=[("call", "Read",
                  {"offset": 10, "limit": None, "file_path": {"a": [1, 2.5, True], "b": {"c": None}}})]),
    dict(name="invalid_json_kept_as_string", thinking=False,
         out=[block(inv("Bash", par("command", "{broken", "false"))), E],
         events=[("call", "Bash", {"command": "{broken"})]),
    dict(name="nan_refused", thinking=False, out=[block(inv("Bash", par("timeout", "NaN", "false"))), E],
         events=[("call", "Bash", {"timeout": "NaN"})]),
    dict(name="huge_number_refused", thinking=False,
         out=[block(inv("Bash", par("timeout", "1e999", "false"))), E],
         events=[("call", "Bash", {"timeout": "1e999"})]),
    dict(name="infinity_in_array_refused", thinking=False,
         out=[block(inv("Bash", par("timeout", "[1, Infinity]", "false"))), E],
         events=[("call", "Bash", {"timeout": "[1, Infinity]"})]),
    dict(name="missing_string_attr_json", thinking=False,
         out=[block(inv("Read", par("offset", "42", None))), E],
         events=[("call", "Read", {"offset": 42})]),
    dict(name="missing_string_attr_text", thinking=False,
         out=[block(inv("Bash", par("command", "echo hi", None))), E],
         events=[("call", "Bash", {"command": "echo hi"})]),
    dict(name="missing_param_close", thinking=False,
         out=[block(inv("Bash", par("command", "pwd", close=False), par("timeout", "7", "false"))), E],
         events=[("call", "Bash", {"command": "pwd", "timeout": 7})]),
    dict(name="duplicate_param_first_wins", thinking=False,
         out=[block(inv("Bash", par("command", "a"), par("command", "b"))), E],
         events=[("call", "Bash", {"command": "a"})]),
    dict(name="wrapper_collapse", thinking=False,
         out=[block(inv("Read", par("arguments", '{"file_path": "/x"}', "false"))), E],
         events=[("call", "Read", {"file_path": "/x"})]),
    dict(name="no_collapse_when_declared", thinking=False,
         out=[block(inv("Wrap", par("input", '{"x": 1}', "false"))), E],
         events=[("call", "Wrap", {"input": {"x": 1}})]),
    dict(name="dsml_inside_reasoning", thinking=True, out=["Need the file." + block(READ), E],
         events=[("r", "Need the file."), ("call", "Read", {"file_path": "/p/README.md"})]),
    dict(name="redundant_think_absorbed", thinking=True, out=["<think>Plan.</think>Answer.", E],
         events=[("r", "Plan."), ("t", "Answer.")]),
    dict(name="stray_end_think_in_content", thinking=False, out=["A</think>B", E], events=[("t", "AB")]),
    dict(name="unterminated_invoke_dropped", thinking=True, finish="length",
         out=["R</think>" + f"\n\n<{D} calls>\n" + inv("Read", par("file_path", "/p/a"))[:-12]],
         events=[("r", "R"), ("cut", "Read")]),
    dict(name="cut_second_invoke_keeps_first", thinking=True, finish="length",
         out=["R</think>" + f"\n\n<{D} calls>\n" + READ + "\n" + f'<{D} invoke name="Bash">\n'
              + par("command", "rm", close=False)],
         events=[("r", "R"), ("call", "Read", {"file_path": "/p/README.md"}), ("cut", "Bash")]),
    dict(name="text_after_block", thinking=True, out=["R</think>" + block(READ) + "\n\nDone.", E],
         events=[("r", "R"), ("call", "Read", {"file_path": "/p/README.md"}), ("t", "Done.")]),
    dict(name="v4_spelling", thinking=False,
         out=[block(inv("Bash", par("command", "ls", v4=True), v4=True), v4=True), E],
         events=[("call", "Bash", {"command": "ls"})]),
    dict(name="ascii_lookalike_dsml_is_text", thinking=False, out=['Use <|DSML| calls> like this.', E],
         events=[("t", "Use <|DSML| calls> like this.")]),
    dict(name="bpe_spelled_end_think_is_reasoning", thinking=True,
         out=["a ", ("plain", "</think>"), " b</think>c", E], events=[("r", "a </think> b"), ("t", "c")]),
    dict(name="bpe_spelled_dsml_is_text", thinking=False,
         out=["x ", ("plain", f'<{D} invoke name="Read">'), E],
         events=[("t", f'x <{D} invoke name="Read">')]),
    dict(name="unicode_multibyte", thinking=False, out=["héllo 世界 🎉 ｜ok｜", E],
         events=[("t", "héllo 世界 🎉 ｜ok｜")]),
    dict(name="string_value_with_lt_and_newlines", thinking=False,
         out=[block(inv("Bash", par("command", "a < b\n</div>\nc\n"))), E],
         events=[("call", "Bash", {"command": "a < b\n</div>\nc\n"})]),
    dict(name="separator_newlines_dropped", thinking=False, out=["Text\n\n\n" + block(READ).lstrip("\n"), E],
         events=[("t", "Text"), ("call", "Read", {"file_path": "/p/README.md"})]),
    dict(name="whitespace_only_content_not_emitted", thinking=True, out=["R</think>\n\n", E],
         events=[("r", "R")]),
    dict(name="held_lt_flushed_at_eos", thinking=False, out=["a <", E], events=[("t", "a <")]),
    dict(name="tool_choice_none_suppresses_block", thinking=False, tools_enabled=False,
         out=["Sure." + block(READ), E],
         events=[("t", "Sure.")]),
    dict(name="bare_invoke_declared_recovered", thinking=False, out=["\n\n" + READ, E],
         events=[("call", "Read", {"file_path": "/p/README.md"})]),
    dict(name="bare_invoke_undeclared_stays_text", thinking=False,
         out=["x " + inv("Nope", par("a", "1")), E],
         events=[("t", "x " + inv("Nope", par("a", "1")))]),
    dict(name="empty_reasoning", thinking=True, out=["</think>Hi", E], events=[("t", "Hi")]),
    dict(name="eos_inside_reasoning", thinking=True, out=["Thinking", E], events=[("r", "Thinking")]),
    dict(name="leading_newlines_kept_in_text", thinking=False, out=["\n\nHello", E],
         events=[("t", "\n\nHello")]),
    dict(name="reasoning_cut_by_length", thinking=True, finish="length", out=["Long thought"],
         events=[("r", "Long thought")]),
    dict(name="invoke_without_params", thinking=False, out=[block(inv("Bash")), E],
         events=[("call", "Bash", {})]),
    dict(name="nested_json_with_close_like_text", thinking=False,
         out=[block(inv("Read", par("file_path", '{"html": "</p> <a>"}', "false"))), E],
         events=[("call", "Read", {"file_path": {"html": "</p> <a>"}})]),
    dict(name="reasoning_trailing_newline_kept", thinking=True, out=["Plan.\n</think>Go", E],
         events=[("r", "Plan.\n"), ("t", "Go")]),
    # --- DSML corners: when a DSML token opens a block; text is never dropped ---------
    dict(name="calls_tag_in_prose_stays_text", thinking=False, out=[f"Use <{D} calls> to call tools.", E],
         events=[("t", f"Use <{D} calls> to call tools.")]),
    dict(name="calls_tag_in_reasoning_prose_stays_reasoning", thinking=True,
         out=[f"The <{D} calls> tag opens a block.</think>Done.", E],
         events=[("r", f"The <{D} calls> tag opens a block."), ("t", "Done.")]),
    dict(name="calls_tag_then_text_then_invoke_is_text_then_bare_call", thinking=False,
         out=[f"A <{D} calls>\nnote\n" + READ, E],
         events=[("t", f"A <{D} calls>\nnote"), ("call", "Read", {"file_path": "/p/README.md"})]),
    dict(name="empty_block_at_eos_is_markup", thinking=False, out=[f"Hi\n\n<{D} calls>\n", E],
         events=[("t", "Hi")]),
    dict(name="partial_tag_at_length_is_markup", thinking=False, finish="length",
         out=[f"Hi\n\n<{D} calls>\n<{D} inv"],
         events=[("t", "Hi")]),
    dict(name="junk_in_block_ends_block_as_text", thinking=False,
         out=[f"\n\n<{D} calls>\n" + READ + "\nI will now wait.", E],
         events=[("call", "Read", {"file_path": "/p/README.md"}), ("t", "I will now wait.")]),
    dict(name="text_after_bare_invoke_kept", thinking=False, out=[READ + "\nthen more", E],
         events=[("call", "Read", {"file_path": "/p/README.md"}), ("t", "then more")]),
    dict(name="undeclared_tool_in_block_passed_through", thinking=False,
         out=[block(inv("Nope", par("a", "1", "false"))), E], events=[("call", "Nope", {"a": 1})]),
    dict(name="empty_block_closed", thinking=False, out=["Hi" + f"\n\n<{D} calls>\n</{D} calls>\n\nBye", E],
         events=[("t", "HiBye")]),
    # --- streamed arguments: what the deltas must join to ------------------------------------------
    dict(name="string_value_json_escapes", thinking=False,
         out=[block(inv("Bash", par("command", 'echo "q" \\ \t 世 🎉\n'))), E],
         events=[("call", "Bash", {"command": 'echo "q" \\ \t 世 🎉\n'})]),
    dict(name="string_value_with_fake_dsml_tag", thinking=False,
         out=[block(inv("Bash", par("command", f"a <{D} foo b</{D} bar"))), E],
         events=[("call", "Bash", {"command": "a < foo b</ bar"})]),
    dict(name="missing_close_strips_trailing_newlines", thinking=False,
         out=[block(inv("Bash", par("command", "pwd\n\n", close=False), par("timeout", "7", "false"))), E],
         events=[("call", "Bash", {"command": "pwd", "timeout": 7})]),
    dict(name="missing_close_before_invoke_end", thinking=False,
         out=[block(inv("Bash", par("command", "ls\n", close=False))), E],
         events=[("call", "Bash", {"command": "ls"})]),
    dict(name="wrapper_not_collapsed_with_second_param", thinking=False,
         out=[block(inv("Read", par("arguments", '{"file_path": "/x"}', "false"),
                        par("offset", "3", "false"))), E],
         events=[("call", "Read", {"arguments": {"file_path": "/x"}, "offset": 3})]),
    dict(name="wrapper_string_not_collapsed", thinking=False,
         out=[block(inv("Read", par("arguments", '{"file_path": "/x"}'))), E],
         events=[("call", "Read", {"arguments": '{"file_path": "/x"}'})]),
    dict(name="big_integer_value", thinking=False,
         out=[block(inv("Bash", par("timeout", "123456789012345678901234567890", "false"),
                        par("command", "x"))), E],
         events=[("call", "Bash", {"timeout": 1.2345678901234568e29, "command": "x"})]),  # orjson: a float
    dict(name="string_attr_with_gt_inside", thinking=False,
         out=[block(inv("Bash", f'<{D} parameter name="command" string="tr>ue">v</{D} parameter>')), E],
         events=[("call", "Bash", {"command": "v"})]),
    dict(name="cut_inside_string_value", thinking=True, finish="length",
         out=["R</think>" + f"\n\n<{D} calls>\n" + f'<{D} invoke name="Bash">\n'
              + par("command", "cat <<EOF\nline", close=False)],
         events=[("r", "R"), ("cut", "Bash")]),
    dict(name="long_string_value", thinking=False,
         out=[block(inv("Bash", par("command", "\n".join(f"line {k} <tag> & \"x\"" for k in range(60))))), E],
         events=[("call", "Bash", {"command": "\n".join(f"line {k} <tag> & \"x\"" for k in range(60))})]),
]
