"""Chat formats: how a model's chat template writes tool calls, read off the template itself, so that the tool loop
(minigdpo/tools.py) runs every family TRL 1.16's GRPOTrainer trains with tools, and reads their turns as TRL does.

TRL keeps one hand-written response template per family, picked by the chat template's exact text
(trl/chat_template_utils.py, add_response_schema). Here the format is derived: the tokenizer's chat template renders
stand-in messages (a call with sentinel names and arguments, two calls, reasoning, an answer), the sentinels are found
in what it writes, and the text around them becomes a transformers `response_template` (transformers >= 5.13,
transformers/utils/chat_parsing). `check` then reads the stand-ins back. A tokenizer's own response_template wins.

    response_template(tok)                        the tokenizer's own, else derived; TemplateError where none is found
    parse(tok, template, ids, prefix_ids, tools)  one turn's assistant message, as TRL's parse_response gives it
    suffix_ids(tok, tool_messages)                the template's tokens for tool results and the next prompt
    check(tok, model)                             the start check (the template it passed), or one TemplateError line
"""

import re
from os.path import commonprefix

# Sentinels: strings no template writes by itself, to be found again in what it renders
NAME, NAME2, KEY, NUM, KEY2 = "fn_q7x3k", "fn_z8w2m", "key_a4r9", "num_b5s8", "key_c6t7"
VAL, VAL2, INT, REASON, THINK = "val_d3u6", "val_h2j5", 90217, "why_e2v5", "thought_m4n6"
USER, USER2, ANSWER, RESULT = "ask_p8r1", "ask_s3t4", "answer_f1w4", "result_g9y3"
ARGS = {KEY: VAL, NUM: INT}
NAMES = r"[\w.\-]+"  # a tool's or an argument's name: OpenAI's [a-zA-Z0-9_-], and dotted ones
SCHEMAS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
    KEY: {"type": "string"}, NUM: {"type": "integer"}, KEY2: {"type": "string"}}}}} for n in (NAME, NAME2)]


class TemplateError(ValueError):
    """A chat template the tool loop cannot run; the message is one line naming the template and what fails."""


def _call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _render(tok, messages, prompt=False):
    """The template's text for these messages, or None where it refuses them (templates raise what they like)."""
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    except Exception:
        return None


def _lit(text):
    """A regex for text the template writes, any whitespace in or around it matching any amount (or none)."""
    return r"\s*" + r"\s*".join(re.escape(word) for word in text.split()) + r"\s*"


def _either(*texts):
    """A regex for any of these texts (empty ones left out); None where all are empty."""
    kept = list(dict.fromkeys(t.strip() for t in texts if t.strip()))
    return "(?:" + "|".join(_lit(t) for t in kept) + ")" if kept else None


def _after(text, sentinel, stop=None):
    """The text after `sentinel`, up to `stop` where given."""
    begin = text.index(sentinel) + len(sentinel)
    return text[begin:text.index(stop, begin) if stop else len(text)]


def _braces(text, at):
    """(start, end) of the innermost {...} around position `at` (the sentinels hold no braces), or None."""
    starts = [i for i in range(at) if text[i] == "{" and text.count("{", i, at) > text.count("}", i, at)]
    depth = 0  # counts the braces open from starts[-1] on; the box ends where it is back to 0
    ends = (j for j in range(starts[-1] if starts else 0, len(text))
            if (depth := depth + (text[j] == "{") - (text[j] == "}")) == 0)
    end = next(ends, None) if starts else None
    return (starts[-1], end + 1) if end is not None else None


def _header(plain, gen):
    """The assistant's header at the start of the generation prompt `gen`, written as the user's is (the text around
    the role's name), so that what the prompt writes after it (Qwen3.5's "<think>\\n") is the turn's own prefill and
    opens its field; the whole prompt where the user's shape is not found (GPT-OSS, GLM)."""
    role = plain.rfind("user", 0, plain.rindex(USER))
    shape = plain[role + 4:plain.rindex(USER)] if role >= 0 else ""  # "\n", "<|end_header_id|>\n\n", "<|message|>"
    stop = gen.find(shape, 1) if shape else -1  # past the header's opening token: "<|im_start|>assistant\n"
    return gen[:stop + len(shape)] if stop >= 0 else gen


def _derive(tok):
    """The response_template dict read off tok's chat template (module docstring); TemplateError(reason) otherwise."""
    from transformers.utils.chat_parsing.content_parsers import parse_content  # the parser the template will use

    user = [{"role": "user", "content": USER}]
    plain, prompt = _render(tok, user), _render(tok, user, True)
    if not plain or not prompt or USER not in plain:
        raise TemplateError("the chat template cannot write a user turn and a generation prompt")
    base = len(commonprefix([plain, prompt]))
    gen = prompt[base:]
    head = _header(plain, gen)

    def turn(**message):  # what the template writes after the assistant's header, for one last assistant message
        text = _render(tok, user + [{"role": "assistant", "content": "", **message}])
        return text[base + len(head):] if text and text[base:].startswith(head) else None

    one, none, answer = turn(tool_calls=[_call(NAME, ARGS)]), turn(tool_calls=[_call(NAME, {})]), turn(content=ANSWER)
    two = turn(tool_calls=[_call(NAME, {KEY: VAL}), _call(NAME2, {KEY2: VAL2})])
    two = two if two and NAME2 in two else None  # Llama 3 refuses two calls, GPT-OSS writes only the first
    if not one or not all(str(s) in one for s in (NAME, KEY, VAL, NUM, INT)) or ANSWER not in (answer or ""):
        raise TemplateError("the chat template does not write an assistant's tool call (its name and arguments) "
                            "and answer")
    end = _after(answer, ANSWER).strip()  # how a turn ends: <|im_end|>, <|eot_id|>, <turn|>

    # 1. The arguments: a string's delimiters are what it adds to an int's key-to-value text (", <|"|>, ' or none)
    kv, delim = _after(one, NUM, str(INT)), _after(one, KEY, VAL)
    delim = delim[len(kv):] if delim.startswith(kv) and _after(one, VAL).startswith(delim[len(kv):]) else ""
    dialect = ({"string_delims": [[delim, delim]]} if delim not in ("", '"') else {}) | (
        {"unquoted_keys": True} if one[one.index(KEY) - 1] not in "\"'" else {})

    def as_json(box):  # what the template's json parser makes of one[box] in this dialect; None where it fails
        try:
            return parse_content(one[slice(*box)], "json", dialect) if box else None
        except ValueError:
            return None

    inner = _braces(one, one.index(KEY))
    inner = inner if as_json(inner) == ARGS else None
    whole = as_json(inner and _braces(one, inner[0]))
    form = "whole" if isinstance(whole, dict) and NAME in whole.values() else "object" if inner else "xml"
    suffix = one[one.index(NAME) + len(NAME):inner[0]] if inner else ""  # GPT-OSS's "<|channel|>... <|message|>"
    if form == "xml":  # no JSON: after the name, each argument is key_lead KEY kv VALUE value_end (tags, or a list)
        if not none or NAME not in none:
            raise TemplateError("the chat template writes arguments neither as JSON nor beside a call without any")
        (k1, v1), (k2, v2) = sorted([(one.index(KEY), one.index(VAL + delim) + len(VAL + delim)),
                                     (one.index(NUM), one.index(str(INT)) + len(str(INT)))])
        named, empty_call, last = one[one.index(NAME) + len(NAME):k1], _after(none, NAME), one[v2:]
        cut = len(commonprefix([named, empty_call]))
        cut -= empty_call[cut - 1:cut] == "<"  # a tag opens after the name's own suffix, not inside it
        suffix, key_lead, tail = named[:cut], named[cut:], empty_call[cut:]
        value_end, between = last[:len(last) - len(tail)], one[v1:k2]
        if not (last.endswith(tail) and between.startswith(value_end) and between.endswith(key_lead)):
            raise TemplateError("the chat template writes a call's arguments in no shape that repeats")
        gap = _lit(between[len(value_end):len(between) - len(key_lead)]) + _lit(key_lead)  # between values, to a key
        value = _lit(value_end) if value_end.strip() else f"(?={gap}{NAMES}{_lit(kv)}|(?:{gap}(?:{NAMES})?)?\\Z)"
        tags = {"tag_pattern": f"{_lit(key_lead)}(?P<key>{NAMES}){_lit(kv)}(?P<value>.*?){value}", "value_parser": (
            {"name": "json", "args": {"string_delims": [[delim, delim]], "allow_non_json": True}} if delim else
            {"name": "text"})}  # raw text is typed by the tools' schemas, as TRL has it on transformers >= 5.15

    def span(text, name, key, values):  # (where the call named `name` starts, where its arguments end)
        if form == "xml":
            last = max(text.index(v, text.index(name)) + len(v) for v in values)
            return text.index(name), re.compile(_lit(value_end)).match(text, last).end()
        box = _braces(text, text.index(key))
        box = _braces(text, box[0]) if form == "whole" else box
        return (box[0] if form == "whole" else text.rfind(name, 0, box[0])), box[1]

    start, stop = span(one, NAME, KEY, [VAL + delim, str(INT)])

    # 2. Reasoning: the text around it, where the template writes it beside an answer, or else beside a call
    fields, blank = {}, re.compile("(?!)")
    for message, follows in (({"content": ANSWER}, ANSWER), ({"tool_calls": [_call(NAME, ARGS)]}, None)):
        text = turn(reasoning_content=REASON, thinking=THINK, **message)
        said = next((s for s in (REASON, THINK) if text and s in text), None)
        if not said:
            continue
        upto = text.index(follows) if follows else span(text, NAME, KEY, [VAL + delim, str(INT)])[0]
        opener, mid = text[:text.index(said)].strip(), text[text.index(said) + len(said):upto]
        unsaid = answer[:answer.index(ANSWER)] if follows else one[:start]  # the same turn without reasoning
        kept = "" if unsaid.strip().startswith(opener) else commonprefix([mid[::-1], unsaid[::-1]])
        closer = mid[:len(mid) - len(kept)].strip()  # what follows keeps its own open: GPT-OSS's final channel
        if opener and closer:  # where a new message of the turn follows, its header may not (GPT-OSS)
            ends = _lit(closer.removesuffix(head.strip())) + f"(?:{_lit(head)})?" if closer.endswith(
                head.strip()) and closer != head.strip() else _lit(closer)
            fields["reasoning_content" if said == REASON else "thinking"] = {
                "open_pattern": _lit(opener), "close_pattern": ends, "content": "text"}
            blank = re.compile(_lit(opener) + _lit(closer))  # the empty block written where none was given
            break
    unblank = lambda text: text[blank.match(text).end():] if blank.match(text) else text  # noqa: E731
    lead = unblank(one[:start]).strip()

    # 3. The calls: their head and tail, and what a second call or a block of calls adds (LFM2's [a(), b()])
    after = one[stop:].rstrip()
    tail, block, again = (after[:len(after) - len(end)] if end and after.endswith(end) else after).strip(), "", ""
    if two:
        gap = two[span(two, NAME, KEY, [VAL + delim])[1]:span(two, NAME2, KEY2, [VAL2 + delim])[0]].strip()
        cut = len(commonprefix([tail, gap]))
        cut = next((c for c in range(cut, -1, -1) if gap[c:].strip().endswith(lead)), cut)  # Gemma's <|tool_...
        tail, block, again = tail[:cut], tail[cut:], gap[cut:]
    turn_ends = [end, tok.eos_token or ""]  # the eos token ends a turn too (Gemma 4's <eos> after <turn|>)
    if block and not (end and one.rstrip().endswith(end)):  # not a block's close: the tool turn's end (Gemma 4)
        turn_ends, block = turn_ends + [block], ""
    close = (_lit(tail) + (f"(?:{_lit(block)})?" if block.strip() else "")) if tail.strip() else _either(end)
    if not close or not (lead or form == "whole"):
        raise TemplateError("the chat template writes nothing around a call to tell where it starts and ends")
    if form == "whole":  # one JSON object holds the name and the arguments (Qwen2.5; Llama 3's "parameters")
        keys = [next(k for k, v in whole.items() if v == want) for want in (NAME, ARGS)]
        named = one.index(NAME, start)  # where no mark opens a call (Llama 3), its object's start does, to a name
        calls = {"open_pattern": _either(lead, again) or
                 f"(?={_lit(one[start:named])}{NAMES}{re.escape(one[named + len(NAME)])})",
                 "content": "json", "content_args": dialect, "transform": {"type": "function", "function": (
                     "{content}" if keys == ["name", "arguments"] else
                     {"name": "{content.%s}" % keys[0], "arguments": "{content.%s}" % keys[1]})}}
    else:  # a JSON object after the name (GPT-OSS; Gemma 4 in its own dialect), or key=value pairs
        calls = {"open_pattern": _either(lead, again) + f"(?P<name>{NAMES})" + _lit(suffix),
                 "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}} | (
            {"content": "json", "content_args": dialect} if form == "object" else
            {"content": "xml-inline", "content_args": tags})
    fields["tool_calls"] = calls | {"close_pattern": close, "repeats": True}

    # 4. The answer: its own open where it has one (GPT-OSS's final channel); it ends where a turn ends
    nxt = _render(tok, user + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": USER2}]) or ""
    if not end and ANSWER in nxt and USER2 in nxt:  # a turn that writes no end ends where the next begins (GLM)
        turn_ends.append(_after(nxt, ANSWER, USER2))
    opens = unblank(answer[:answer.index(ANSWER)]).strip()
    fields["content"] = ({"open_pattern": _lit(opens)} if opens else {}) | (
        {"close_pattern": _either(*turn_ends)} if _either(*turn_ends) else {}) | {"content": "text"}

    # 5. Where a turn starts: its header, and after a tool's result where the turn goes on (Gemma 4)
    result = _render(tok, user + [{"role": "assistant", "content": "", "tool_calls": [_call(NAME, ARGS)]},
                                  {"role": "tool", "name": NAME, "content": RESULT}], True) or ""
    goes_on = RESULT in result and not result.endswith(gen) and _after(result, RESULT).strip()
    return {"defaults": {"role": "assistant"}, "start_anchor": [head] + ([_after(result, RESULT)] if goes_on else []),
            "fields": fields}


def _named(tokenizer):
    return tokenizer.name_or_path or "the tokenizer"


def _ids(tokenizer, messages, prompt=False):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True, return_dict=False)


def response_template(tokenizer):
    """The tokenizer's own `response_template` where it has one, else the one its chat template's renderings show
    (module docstring): the turn's header as start anchor; reasoning, tool calls and the answer as fields.
    TemplateError, in one line naming the tokenizer, where no format can be read off the template."""
    if getattr(tokenizer, "response_template", None) is not None:
        return tokenizer.response_template
    try:
        return _derive(tokenizer)
    except TemplateError as e:
        raise TemplateError(f"{_named(tokenizer)}: {e}") from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:  # a rendering of a shape not met here
        raise TemplateError(f"{_named(tokenizer)}: no tool-call format can be read off the chat template "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def parse(tokenizer, template, ids, prefix_ids, tools=None):
    """The assistant message in one turn's token ids, as TRL's parse_response (and _validate_tool_calls) gives it:
    `prefix_ids` are the tokens before the turn (the template may have opened a field there), `tools` type the
    arguments ("7" is 7 for an int parameter). The content is a string, a trailing eos token removed; a turn that
    cannot be parsed, or with any call lacking a string name, is plain text (its ids decoded without special
    tokens) and calls nothing. Missing arguments are {} (Qwen3.5 writes none for a call that takes none)."""
    try:
        message = tokenizer.parse_response(ids, schema=template, prefix=prefix_ids, tools=tools)
        if message is None:  # a turn cut so short that nothing is left
            raise ValueError("nothing parsed")
        if isinstance(message.get("content"), str):
            message["content"] = message["content"].removesuffix(tokenizer.eos_token)
        message["content"] = message.get("content") or ""
        for call in message.get("tool_calls") or []:  # a string or dict here fails below, as a non-list does in TRL
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError("a tool call without a string name")
            function["arguments"] = {} if function.get("arguments") is None else function["arguments"]
        return message
    except (ValueError, TypeError):
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def suffix_ids(tokenizer, tool_messages):
    """The token ids the template writes after an assistant turn's end token for these tool messages and the next
    generation prompt: TRL's _get_tool_suffix_ids (two renderings of a stand-in turn that calls the first tool,
    subtracted, cut after the last eos: a "\\n" after it is glue). Where the template writes that turn otherwise once
    results follow (Qwen3 drops the last turn's <think> block), the full rendering is cut after the token that ends
    the turn, which is what TRL gets from its training template. TemplateError where neither cut is found."""
    head = [{"role": "user", "content": "dummy"},
            {"role": "assistant", "content": "", "tool_calls": [_call(tool_messages[0]["name"], {})]}]
    try:
        before, after = _ids(tokenizer, head), _ids(tokenizer, head + list(tool_messages), True)
    except Exception as e:  # whatever the template raises
        raise TemplateError(f"{_named(tokenizer)}: the chat template cannot write tool results ({e})") from None
    stops = [i for i, t in enumerate(before) if t == tokenizer.eos_token_id]
    before = before[:stops[-1] + 1] if stops else before
    if tool_messages[0]["name"] not in tokenizer.decode(before):  # the eos ends an earlier turn, not the call's
        raise TemplateError(f"{_named(tokenizer)}: its eos token {tokenizer.eos_token!r} does not end the turn that "
                            "calls a tool, so tool results cannot be cut after it (set the eos its turns end with)")
    if after[:len(before)] == before:
        return after[len(before):]
    fork = len(commonprefix([before, after]))
    if before and before[-1] in after[fork:]:
        return after[after.index(before[-1], fork) + 1:]
    raise TemplateError(f"{_named(tokenizer)}: the chat template's tool results cannot be cut from its renderings")


def check(tokenizer, model):
    """The start check: the template writes a tool-calling conversation (a call and its result: TRL's
    supports_tool_calling); the response template (own or derived) reads back from the template's tokens each
    stand-in it writes (a call, two calls, an answer, reasoning); tool results can be cut out. Returns the response
    template; else TemplateError, one line naming the model and what fails."""
    user, thought = [{"role": "user", "content": USER}], {"reasoning_content": REASON, "thinking": THINK}
    result = [{"role": "tool", "name": NAME, "content": RESULT}]
    text = _render(tokenizer, user + [{"role": "assistant", "content": "", "tool_calls": [_call(NAME, ARGS)]}] + result)
    if not text or not all(str(s) in text for s in (NAME, KEY, VAL, INT, RESULT)):
        raise TemplateError(f"{model}: its chat template cannot write a tool-calling conversation (a call and its "
                            "result): use a model whose template takes tools")
    try:
        template, prompt = response_template(tokenizer), _ids(tokenizer, user, True)
        for message in ({"tool_calls": [_call(NAME, ARGS)]}, {"content": ANSWER}, {"content": ANSWER, **thought},
                        {"tool_calls": [_call(NAME, {KEY: VAL}), _call(NAME2, {KEY2: VAL2})]},
                        {"tool_calls": [_call(NAME, ARGS)], **thought}):
            message = {"role": "assistant", "content": "", **message}
            text, calls = _render(tokenizer, user + [message]), [c["function"] for c in message.get("tool_calls", [])]
            if text and all(c["name"] in text for c in calls):  # a stand-in the template writes (not Llama's two)
                whole = _ids(tokenizer, user + [message])
                cut = len(commonprefix([prompt, whole]))  # the prompt's part it shares (Qwen3.5's nothink)
                got = parse(tokenizer, template, whole[cut:], whole[:cut], SCHEMAS)
                keys = ["content"] + [k for k, v in thought.items() if k in message and v in text]
                if [got.get(k) for k in keys] + [c.get("function") for c in got.get("tool_calls", [])] != [
                        message[k] for k in keys] + calls:
                    raise TemplateError(f"the response template reads the stand-in {message} back as {got}")
        suffix_ids(tokenizer, result)
    except TemplateError as e:
        raise TemplateError(f"{model}: {str(e).removeprefix(_named(tokenizer) + ': ')}") from None
    return template
