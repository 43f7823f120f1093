"""Every model family TRL 1.16 trains with tools, through the tool loop and train.py: for each, a tiny tokenizer that
holds the family's special tokens under its real chat template (tests/test_chat_formats.py builds them), and turns the
family's own template writes (a call to a tool, a direct answer, an answer after the tool's result), scripted.

- the loop: TRL's own _tool_call_loop (with TRL's hand-written response template, and its training template where it
  swaps one in) and minigdpo's Agent give the same tokens, mask, messages and counts on the same scripted turns: the
  start check passes, the family's calls are parsed and run, the tools' suffix tokens are TRL's;
- a step trains: train.py with a tiny random Llama of the family's vocabulary, its sampler scripted, runs the loop,
  calls the tool, and its update moves the weights.

Run: pytest tests/test_families.py   (about two minutes on 2 cores)
"""

import asyncio
import copy
import json
import os
from types import SimpleNamespace

import pytest
import torch

from conftest import read_jsonl
from minigdpo import tools
from minigdpo.sampler import Completion, SamplingParams

trl = pytest.importorskip("trl")
from test_chat_formats import FAMILIES, tokenizer  # noqa: E402 (TRL's templates, read at test time)
from tool_fixtures import add  # noqa: E402

USER = "What is 2+3? Answer as <answer>N</answer>."


def turn_ids(tok, before, message):
    """The tokens of an assistant `message` as the model would write them after the conversation `before` (its
    template's generation prompt), up to the token that ends its turn: the eos where the template writes one in the
    turn, else the end of what it writes (GPT-OSS's <|call|>, Gemma 4's <|tool_response>)."""
    prompt = tok.apply_chat_template(before, tools=[add], add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    whole = tok.apply_chat_template(before + [message], tools=[add], tokenize=True, return_dict=False)
    turn = whole[len(os.path.commonprefix([prompt, whole])):]
    return turn[:turn.index(tok.eos_token_id) + 1] if tok.eos_token_id in turn else turn


def scripts(tok):
    """(calling, answering): a rollout that calls add(2, 3) then answers 5, and one that answers at once."""
    user = [{"role": "user", "content": USER}]
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": {"a": 2, "b": 3}}}]}
    answer = {"role": "assistant", "content": "<answer>5</answer>"}
    after = user + [call, {"role": "tool", "name": "add", "content": "5"}]
    return [turn_ids(tok, user, call), turn_ids(tok, after, answer)], [turn_ids(tok, user, answer)]


class ScriptedIds:
    """A sampler that writes token-id turns: the j-th sample of a group follows script[j]; a later turn of a rollout
    is found by the tokens it started with. Also what train.py needs of a sampler (weights, sleep, close)."""

    adapters_only = False

    def __init__(self, script):
        self.script, self.started = script, []

    def generate(self, prompts, n, params):
        limits = params.max_new_tokens if isinstance(params.max_new_tokens, list) else [params.max_new_tokens] * len(
            prompts)
        out = []
        for prompt, limit in zip(prompts, limits):
            known = [s for s in self.started if prompt[:len(s[0])] == s[0]]
            if known:
                _, j, k = max(known, key=lambda s: len(s[0]))
                ids = self.script[j][k + 1][:limit]
                self.started.append((prompt + ids, j, k + 1))
                out.append([Completion(ids, [-0.5] * len(ids), "stop", "")])
                continue
            group = []
            for j in range(n):
                ids = self.script[j % len(self.script)][0][:limit]
                self.started.append((prompt + ids, j % len(self.script), 0))
                group.append(Completion(ids, [-0.5] * len(ids), "stop", ""))
            out.append(group)
        return out

    def load_weights(self, named):
        for _ in named:
            pass

    def sleep(self):
        pass

    def wake(self):
        pass

    def close(self):
        pass


def trl_rollouts(tok, script):
    """TRL 1.16's GRPOTrainer._tool_call_loop on one scripted rollout per script, set up as TRL sets a trainer up for
    tools: add_response_schema's response template, and its training template where the chat template is not
    prefix-preserving."""
    from minigdpo.scoring import EventLoop

    utils = trl.chat_template_utils
    tok = utils.add_response_schema(copy.deepcopy(tok))
    template = None if utils.is_chat_template_prefix_preserving(tok) else utils.get_training_chat_template(tok)
    prompts = [[{"role": "user", "content": USER}] for _ in script]
    prompt_ids = [tok.apply_chat_template(p, tools=[add], chat_template=template, add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in prompts]
    sampler = ScriptedIds(script)
    first = [Completion(turns[0], [-0.5] * len(turns[0]), "stop", "") for turns in script]  # rollout j: script j
    sampler.started = [(p + c.token_ids, j, 0) for j, (p, c) in enumerate(zip(prompt_ids, first))]
    trainer = SimpleNamespace(
        processing_class=tok, _tokenizer=tok, chat_template=template, chat_template_kwargs={}, _is_vlm=False,
        max_completion_length=400, max_tool_calling_iterations=4, use_vllm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096)), environment_factories=None,
        tools=[add], async_loop=EventLoop().loop, _sync_tool_dicts=[{"add": add}] * len(script),
        _async_tool_dicts=[{}] * len(script))
    trainer._get_tool_suffix_ids = trl.GRPOTrainer._get_tool_suffix_ids.__get__(trainer)

    def single_turn(ids, *args, **kwargs):
        turns = [g[0] for g in sampler.generate(ids, 1, SamplingParams(max_new_tokens=10**6))]
        return [c.token_ids for c in turns], [c.logprobs for c in turns]

    trainer._generate_single_turn = single_turn
    completions = [[utils.parse_response(tok, c.token_ids, prefix=p, tools=[add])] for c, p in zip(first, prompt_ids)]
    mask, messages, ids, _, calls, failures, _ = trl.GRPOTrainer._tool_call_loop(
        trainer, prompts, prompt_ids, [c.token_ids for c in first], completions, [c.logprobs for c in first], None, {})
    return prompt_ids, ids, mask, messages, calls, failures


@pytest.mark.parametrize("family", FAMILIES)
def test_trls_loop_and_ours_agree_on_the_familys_own_turns(family):
    tok = tokenizer(family)
    calling, answering = scripts(tok)
    prompt_ids, trl_ids, trl_mask, trl_messages, trl_calls, trl_failures = trl_rollouts(tok, [calling, answering])
    agent = tools.Agent(tools.Toolbox(["tests.tool_fixtures:add"]), tok, 4, f"tiny+{family}", 4096)
    example = {"messages": [{"role": "user", "content": USER}]}
    shared, groups, counts = agent.rollouts([example], 2, SamplingParams(max_new_tokens=400),
                                            ScriptedIds([calling, answering]), 4096, {})
    assert shared[0] == prompt_ids[0]
    for c, ids, mask, messages in zip(groups[0], trl_ids, trl_mask, trl_messages):
        assert (c.token_ids, c.tool_mask, c.messages) == (ids, mask, messages), tok.decode(c.token_ids)
    assert counts["calls/add"] == trl_calls == 1 and counts["failures/add"] == trl_failures == 0
    called = groups[0][0]
    assert called.messages[1] == {"role": "tool", "name": "add", "content": "5"}
    assert called.messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": USER}], "answer": "5", "kind": "easy"})
                            + "\n" for _ in range(4)))
    return str(path)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_step_trains_with_the_familys_template(family, rows, tmp_path, monkeypatch):
    """One step of train.py: the start check passes, half of each group calls the tool in the family's format and
    answers after its result, the other half answers at once; the rewards tell them apart and the update moves the
    weights."""
    import train
    from minigdpo import models

    tok = tokenizer(family)
    path = str(tmp_path / "model")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                 tie_word_embeddings=True)).save_pretrained(path)
    tok.save_pretrained(path)
    monkeypatch.setattr(train, "make_sampler", lambda *a, **k: ScriptedIds(list(scripts(tok))))
    out = str(tmp_path / "run")
    train.run_training(["--preset", "smoke", "--model", path, "--task", "prompts", "--data", rows, "--tools",
                        "tests.tool_fixtures:add", "--rewards", "solved,tool_economy", "--group-size", "2",
                        "--batch-size", "4", "--max-steps", "1", "--max-new-tokens", "200", "--max-prompt-len",
                        "3000", "--lr", "1e-2", "--output-dir", out, "--save-every", "0", "--no-final-eval"])
    (row,) = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert row["tools/add/calls"] == 2 and row["tools/add/failures"] == 0 and row["tools/call_frequency"] == 0.5
    assert row["reward/tool_economy/mean"] == 0.75 and 0 < row["tools/token_frac"] < 1
    trained = models.load_model(os.path.join(out, "checkpoints", "step_000001", "hf"))
    start = models.load_model(path)
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), start.parameters()))
