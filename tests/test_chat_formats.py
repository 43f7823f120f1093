"""Chat formats (minigdpo/chat_formats.py) against TRL 1.16, the oracle, for every family TRL trains with tools.

Each family gets a tiny byte-level tokenizer holding its special tokens as single tokens, its real eos token, and TRL's
copy of its chat template. On it, the response template minigdpo derives from the chat template must parse every
turn that template writes (no call, one call, two calls, content and calls, typed arguments, reasoning) and malformed
turns (a call without a name, a non-string name, broken JSON, one good and one bad call) exactly as TRL's own
hand-written template does (add_response_schema + parse_response); suffix_ids must equal TRL's _get_tool_suffix_ids
(with TRL's training template where TRL swaps one in); check must pass every family and refuse in one line the
templates that cannot call tools.

Run: pytest tests/test_chat_formats.py   (CPU, offline, about 15 s on 2 cores)
"""

import copy
import functools
import os
import re
from types import SimpleNamespace

import pytest

from conftest import ROOT
from minigdpo import chat_formats, models

trl = pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

QWEN = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<tool_response>",
        "</tool_response>", "<think>", "</think>"]
LLAMA = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
LFM = ["<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
       "<|tool_response_start|>", "<|tool_response_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<think>",
       "</think>"]
GEMMA = ["<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>",
         '<|"|>', "<|channel>", "<channel|>", "<|tool>", "<tool|>", "<|think|>"]
# TRL's name for the chat template: (the real tokenizer's eos token, its bos token, the special tokens it writes)
FAMILIES = {
    **{name: ("<|im_end|>", None, QWEN) for name in (
        "qwen2_5", "qwen3", "qwen3_instruct_2507", "qwen3_vl", "qwen3_5_think", "qwen3_5_nothink", "qwen3_6",
        "qwen3_8", "nemotron_3_nano", "nemotron_3_super", "nemotron_3_ultra", "nemotron_3_5_lightning")},
    "llama3_1": ("<|eot_id|>", "<|begin_of_text|>", LLAMA),
    "llama3_2": ("<|eot_id|>", "<|begin_of_text|>", LLAMA),
    "gptoss": ("<|return|>", None, ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>",
                                    "<|constrain|>", "<|endoftext|>"]),
    "glm4moe": ("<|endoftext|>", None, ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                                        "<|observation|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
                                        "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                                        "<tool_response>", "</tool_response>"]),
    **{name: ("<|im_end|>", "<|startoftext|>", LFM) for name in ("lfm2_v2", "lfm2_2_5", "lfm2_2_5_v2", "lfm2_2_5_vl")},
    **{name: ("<eos>", "<bos>", GEMMA) for name in ("gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5")},
}
DEEPSEEK = ("<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", ["<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
            "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"])


def add(a: int, b: int):
    """Adds two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def act(s: str, i: int, f: float, b: bool, l: list, d: dict):  # noqa: E741
    """Takes one argument of each JSON type.

    Args:
        s: a string
        i: an integer
        f: a number
        b: a boolean
        l: a list
        d: an object
    """


TOOLS = [add, act]


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# The turns each family's template renders: no call, calls of every argument type, two calls, content and calls,
# reasoning (a template that does not write a message, Llama 3's two calls, is skipped for it)
MESSAGES = [
    {"content": "Just an answer."},
    {"content": "", "tool_calls": [call("add", a=7, b=5)]},
    {"content": "", "tool_calls": [call("add", a="7", b="5")]},
    {"content": "", "tool_calls": [call("act", s="x y", i=3, f=1.5, b=True, l=[1, "a"], d={"k": [2]})]},
    {"content": "", "tool_calls": [call("add")]},
    {"content": "", "tool_calls": [call("add", a=1, b=2), call("act", s="z")]},
    {"content": "Let me add.", "tool_calls": [call("add", a=1, b=2)]},
    {"content": "The answer is 3.", "reasoning_content": "I think so.", "thinking": "I think so."},
    {"content": "", "reasoning_content": "Need a tool.", "thinking": "Need a tool.", "tool_calls": [call("add", a=1)]},
]
USER = [{"role": "user", "content": "What is 2+3?"}]


@functools.cache
def tokenizer(name):
    """The offline byte-level tokenizer with the family's special tokens as single tokens, its eos (and bos), and
    TRL's copy of its chat template."""
    eos, bos, specials = {**FAMILIES, "deepseek_r1_distill": DEEPSEEK}[name]
    tok = models.tiny_tokenizer()
    tok.add_tokens(sorted(set(specials + [eos]) - set(tok.get_vocab())), special_tokens=True)
    tok.eos_token, tok.bos_token = eos, bos
    tok.chat_template = getattr(trl.chat_template_utils, f"{name}_chat_template")
    return tok


def ids(tok, messages, prompt=False):
    return tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=prompt, tokenize=True,
                                   return_dict=False)


def turns(tok, eos_after=True):
    """(label, the prompt's ids, the turn's ids) for each message the template writes, as the model would write it
    after the prompt, followed by an eos token (where eos_after), and for its malformed versions."""
    prompt = ids(tok, USER, True)
    for message in MESSAGES:
        try:
            whole = ids(tok, USER + [{"role": "assistant", **message}])
        except Exception:  # the template refuses it (Llama 3: one call at a time)
            continue
        turn = whole[len(os.path.commonprefix([prompt, whole])):]
        label = str(message)[:70]
        yield label, prompt, turn
        if eos_after:
            yield f"{label}, then eos", prompt, turn + [tok.eos_token_id]
        if not message.get("tool_calls"):  # an answer as written before a next turn, to that turn's first token
            later = ids(tok, USER + [{"role": "assistant", **message}, {"role": "user", "content": "Thanks."}])
            later = later[len(os.path.commonprefix([prompt, later])):]  # (GLM stops at the next turn's <|user|>)
            done = next(i for i in range(len(later)) if message["content"] in tok.decode(later[:i]))
            stop = next(i for i in range(done, len(later)) if later[i] in tok.added_tokens_decoder)
            yield f"{label}, stopped where the next turn starts", prompt, later[:stop + 1]
        text = tok.decode(turn)
        if message.get("reasoning_content", "?") in text:  # the budget runs out at the token that closes reasoning
            said = next(i for i in range(len(turn)) if message["reasoning_content"] in tok.decode(turn[:i]))
            close = next((i for i in range(said, len(turn)) if turn[i] in tok.added_tokens_decoder), None)
            yield f"{label}, cut after its reasoning", prompt, turn[:close + 1] if close else turn
        second = text.find("act")  # where the second call starts, in the two-call turn
        for what, old, new, at in [("a call without a name", "add", "", 0), ("a non-string name", '"add"', "5", 0),
                                   ("broken JSON", "}", "", 0), ("broken arguments", "7", "{", 0),
                                   ("one good call, one broken", "z", '"z', second)]:
            if at >= 0 and old in text[at:]:  # the first `old` from `at` on becomes `new`
                bad = text[:at] + text[at:].replace(old, new, 1)
                yield f"{label}, {what}", prompt, tok(bad, add_special_tokens=False)["input_ids"]


def trls(tok):
    """The tokenizer as TRL's GRPOTrainer sets it up for tools: its hand-written response template added."""
    return trl.chat_template_utils.add_response_schema(copy.deepcopy(tok))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_derived_template_parses_every_turn_as_trls_own(family):
    tok = tokenizer(family)
    ours, oracle = chat_formats.response_template(tok), trls(tok)
    assert ours != oracle.response_template  # derived, not looked up
    seen = 0  # TRL's GLM-4 MoE template reads an eos after the calls as new content that replaces the content
    for label, prompt, turn in turns(tok, eos_after=family != "glm4moe"):  # before them; ours ends the turn there
        for tools in (TOOLS, None):
            want = trl.chat_template_utils.parse_response(oracle, list(turn), prefix=prompt, tools=tools)
            assert chat_formats.parse(tok, ours, list(turn), prompt, tools) == want, (label, tok.decode(turn))
            seen += 1
    assert seen >= 30  # every family writes most of MESSAGES, and some malformed versions of them


@pytest.mark.parametrize("family", FAMILIES)
def test_a_turn_after_a_tool_result_parses_as_trls(family):
    """The prompt then holds the call and the template's tokens for its result: the turn starts after them (Gemma 4
    goes on in the same turn, after <tool_response|>)."""
    tok = tokenizer(family)
    ours, oracle = chat_formats.response_template(tok), trls(tok)
    talk = USER + [{"role": "assistant", "content": "", "tool_calls": [call("add", a=2, b=3)]}]
    result = [{"role": "tool", "name": "add", "content": "5"}]
    prompt, first = ids(tok, USER, True), ids(tok, talk)
    first = first[len(os.path.commonprefix([prompt, first])):]
    stops = [i for i, t in enumerate(first) if t == tok.eos_token_id]
    prefix = prompt + first[:stops[-1] + 1 if stops else len(first)] + chat_formats.suffix_ids(tok, result)
    for message in MESSAGES[:3] + MESSAGES[6:]:
        try:
            whole, again = ids(tok, talk + result + [{"role": "assistant", **message}]), ids(tok, talk + result, True)
        except Exception:
            continue
        turn = whole[len(os.path.commonprefix([again, whole])):]
        want = trl.chat_template_utils.parse_response(oracle, turn, prefix=prefix, tools=TOOLS)
        assert chat_formats.parse(tok, ours, turn, prefix, TOOLS) == want, tok.decode(turn)


def trl_suffix_ids(tok, tool_messages):
    """TRL's GRPOTrainer._get_tool_suffix_ids, bound to a stand-in trainer set up as TRL's __init__ sets it: its
    training template where the chat template is not prefix-preserving, else none."""
    utils = trl.chat_template_utils
    trainer = SimpleNamespace(processing_class=tok, _tokenizer=tok, chat_template_kwargs={}, _is_vlm=False,
                              chat_template=None if utils.is_chat_template_prefix_preserving(tok) else
                              utils.get_training_chat_template(tok))
    return trl.GRPOTrainer._get_tool_suffix_ids(trainer, tool_messages), trainer.chat_template is not None


@pytest.mark.parametrize("family", FAMILIES)
def test_suffix_ids_are_trls(family):
    tok = tokenizer(family)
    for tool_messages in ([{"role": "tool", "name": "add", "content": "12"}],
                          [{"role": "tool", "name": "add", "content": "12"}, {"role": "tool", "name": "act",
                                                                              "content": "{'error': 'no'}"}],
                          [{"role": "tool", "name": "add", "content": [{"type": "text", "text": "12"}]}]):
        want, swapped = trl_suffix_ids(tok, copy.deepcopy(tool_messages))
        assert chat_formats.suffix_ids(tok, tool_messages) == want, tok.decode(want)
        assert swapped == (family == "qwen3")  # the one template TRL replaces: the cut-after-the-end-token path


@pytest.mark.parametrize("family", FAMILIES)
def test_check_passes_and_types_the_arguments(family):
    """check passes; and with a tool add(a: int, b: int), a call written with "7" gets 7, as the schema says."""
    tok = tokenizer(family)
    chat_formats.check(tok, f"tiny+{family}")
    whole = ids(tok, USER + [{"role": "assistant", "content": "", "tool_calls": [call("add", a="7", b="5")]}])
    prompt = ids(tok, USER, True)
    turn = whole[len(os.path.commonprefix([prompt, whole])):]
    message = chat_formats.parse(tok, chat_formats.response_template(tok), turn, prompt, TOOLS)
    assert message["tool_calls"] == [call("add", a=7, b=5)]


def test_check_refuses_templates_that_cannot_call_tools_in_one_line():
    deepseek, chatml = tokenizer("deepseek_r1_distill"), models.tiny_tokenizer()
    assert chatml.chat_template == models.CHATML
    for tok, model in ((deepseek, "tiny+deepseek-r1-distill"), (chatml, "tiny-random")):
        with pytest.raises(chat_formats.TemplateError, match=f"^{re.escape(model)}: .*tool-calling") as e:
            chat_formats.check(tok, model)
        assert "\n" not in str(e.value)
        with pytest.raises(chat_formats.TemplateError, match="tool call") as e:
            chat_formats.response_template(tok)
        assert "\n" not in str(e.value)


def test_a_tokenizers_own_response_template_wins_and_is_checked():
    """One it ships is kept; check reads the stand-ins back with it too, and refuses one that misreads them."""
    tok = copy.deepcopy(tokenizer("qwen3_5_think"))
    tok.response_template = trls(tok).response_template
    assert chat_formats.response_template(tok) is tok.response_template
    chat_formats.check(tok, "tiny+qwen3.5")
    glm = trls(tokenizer("glm4moe"))  # TRL's: its answer ends only at <|user|>, so the eos stays in it, removed here
    prompt = ids(glm, USER, True)
    assert chat_formats.parse(glm, glm.response_template, glm("Yes.<|endoftext|>")["input_ids"], prompt) == {
        "role": "assistant", "content": "Yes."}
    tok.response_template = trls(tokenizer("qwen2_5")).response_template  # JSON calls, for a template writing XML
    with pytest.raises(chat_formats.TemplateError, match=r"^tiny\+qwen3\.5: the response template reads") as e:
        chat_formats.check(tok, "tiny+qwen3.5")
    assert "\n" not in str(e.value)


def test_minigdpo_neither_imports_trl_nor_names_a_family():
    """The formats are derived: the module imports no TRL, and no string in its code (docstrings and comments
    aside) names a family or holds a family's marker."""
    import ast

    with open(os.path.join(ROOT, "minigdpo", "chat_formats.py")) as f:
        tree = ast.parse(f.read())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and "trl" in (
        getattr(n, "module", None) or "").split(".") + [a.name.split(".")[0] for a in n.names]]
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
            and ast.get_docstring(n) is not None}
    strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and id(n) not in docs]
    assert not [s for s in strings if re.search(r"(?i)qwen|llama|gemma|glm|nemotron|lfm|gpt|deepseek|hermes", s)]
    assert not [s for s in strings if re.search(r"(?<!\?P)<[/|]?\w+\|?>|<\||\|>|functions\.", s)]  # <think>, <|...


def test_an_eos_that_does_not_end_the_calling_turn_is_refused_in_one_line():
    """Gemma 4 with <turn|> as eos (its end-of-turn token, which the calling turn does not end with): TRL cuts the tool
    suffix after the user's turn, and every rollout would get a made-up assistant turn. Refused at start here."""
    tok = copy.deepcopy(tokenizer("gemma4"))
    tok.eos_token = "<turn|>"
    with pytest.raises(chat_formats.TemplateError, match="does not end the turn that calls a tool") as e:
        chat_formats.check(tok, "tiny+gemma4")
    assert "\n" not in str(e.value)
