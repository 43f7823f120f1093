"""Agents (minigdpo/tools.py): TRL's own _tool_call_loop and minigdpo's on the same scripted turns; the calls, their
failures and their concurrency; environments; the budget; what rewards see; the bad inputs, refused in one line;
and train.py and eval.py with a tiny model taught to call a calculator (examples/tiny_agent.py).

Run: pytest tests/test_tools.py   (about two minutes on 2 cores; the tiny agent is built once, about 20 s)
"""

import asyncio
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, read_jsonl, refusal, run
from minigdpo import models, tools
from minigdpo.sampler import SamplingParams
from tool_fixtures import Scripted

sys.path.insert(0, os.path.join(ROOT, "examples"))
CALC = "rewards.calculator:calculate"
FIX = "tests.tool_fixtures:"


def call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="module")
def qwen_tokenizer():
    """The offline byte-level tokenizer with Qwen2.5's chat template and the response template TRL gives it (read
    from TRL's package at test time: TRL is the oracle here)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    tok = models.tiny_tokenizer()
    tok.chat_template = qwen2_5_chat_template
    return add_response_schema(tok)


# The scripted rollouts: the prompt that starts each (its key), and the turns it writes
SCRIPT = {
    "A: 2+3": [[call("calculate", expression="2+3"), "<answer>5</answer>"]],
    "B: direct": [["<answer>7</answer>"]],
    "C: unknown tool": [[call("nope", x=1), "sorry"]],
    "D: a tool that raises": [[call("calculate", expression="2**2"), call("broken", x=3), "gave up"]],
    "E: two rounds": [[call("add", a=1, b=2), call("add", a=3, b=4), "<answer>7</answer>"]],
    "F: sync and async": [[call("shout", text="hi") + "\n" + call("add", a=5, b=6), "done"]],
    "G: a long result": [["x" * 200 + call("calculate", expression="7*191919191919")]],
    "H: a long answer": [[call("calculate", expression="1+1"), "y" * 250]],
    "I: a call without a name": [['<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>', "never"]],
    "J: a name that is not a string": [['<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>', "never"]],
    "K: a valid and a malformed call": [[call("add", a=1, b=2) + '\n<tool_call>\n{"name": "add", "arg</tool_call>',
                                         "never"]],
    "L: a number written as a string": [['<tool_call>\n{"name": "add", "arguments": {"a": "7", "b": 5}}\n</tool_call>',
                                         "<answer>12</answer>"]],
}


def trl_loop(tok, tool_fns, budget, max_iterations, context=4096):
    """TRL 1.16's GRPOTrainer._tool_call_loop on SCRIPT, run as TRL runs it after its first turn (its own
    _get_tool_suffix_ids and parse_response), its generation scripted."""
    from trl import GRPOTrainer
    from trl.chat_template_utils import parse_response

    from minigdpo.scoring import EventLoop

    scripted = Scripted(tok, SCRIPT)
    keys = list(SCRIPT)
    prompts = [[{"role": "user", "content": k}] for k in keys]
    prompt_ids = [tok.apply_chat_template(p, tools=tool_fns, add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for p in prompts]
    first = [g[0] for g in scripted.generate(prompt_ids, 1, SamplingParams(max_new_tokens=budget))]
    trainer = SimpleNamespace(
        processing_class=tok, _tokenizer=tok, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
        max_completion_length=budget, max_tool_calling_iterations=max_iterations, use_vllm=False,
        model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=context)), environment_factories=None,
        tools=tool_fns, async_loop=EventLoop().loop,
        _sync_tool_dicts=[{f.__name__: f for f in tool_fns if not asyncio.iscoroutinefunction(f)}] * len(keys),
        _async_tool_dicts=[{f.__name__: f for f in tool_fns if asyncio.iscoroutinefunction(f)}] * len(keys))
    trainer._get_tool_suffix_ids = GRPOTrainer._get_tool_suffix_ids.__get__(trainer)

    def single_turn(ids, images, fields, num_generations, has_tool_images=False):
        turns = [g[0] for g in scripted.generate(ids, 1, SamplingParams(max_new_tokens=10**6))]
        return [c.token_ids for c in turns], [c.logprobs for c in turns]

    trainer._generate_single_turn = single_turn
    completions = [[parse_response(tok, c.token_ids, prefix=p, tools=tool_fns)] for c, p in zip(first, prompt_ids)]
    mask, completions, ids, logps, calls, failures, _ = GRPOTrainer._tool_call_loop(
        trainer, prompts, prompt_ids, [c.token_ids for c in first], completions, [c.logprobs for c in first], None, {})
    return prompt_ids, ids, mask, completions, calls, failures


@pytest.mark.parametrize("max_iterations", [10, 1])
def test_trls_own_tool_loop_and_ours_give_the_same_tokens_and_mask(qwen_tokenizer, max_iterations):
    """Twelve scripted rollouts: a call, none, an unknown tool, tools that raise, two rounds, sync and async calls
    in one turn, a result that would pass the budget (dropped), an answer the budget cuts, calls without a name or
    with a name that is not a string, a valid call beside a malformed one (all three plain text: TRL's
    _validate_tool_calls), and an argument the schema types."""
    pytest.importorskip("trl")
    from tool_fixtures import add, broken, shout

    from rewards.calculator import calculate

    tok, budget = qwen_tokenizer, 300
    fns = [calculate, add, shout, broken]
    prompt_ids, trl_ids, trl_mask, trl_messages, trl_calls, trl_failures = trl_loop(tok, fns, budget, max_iterations)
    agent = tools.Agent(tools.Toolbox([CALC] + [FIX + n for n in ("add", "shout", "broken")]), tok, max_iterations,
                        "tiny+qwen2.5", 4096)
    examples = [{"messages": [{"role": "user", "content": k}]} for k in SCRIPT]
    shared, groups, counts = agent.rollouts(examples, 1, SamplingParams(max_new_tokens=budget), Scripted(tok, SCRIPT),
                                            4096, {})
    ours = [g[0] for g in groups]
    assert shared == prompt_ids
    for key, c, ids, mask, messages in zip(SCRIPT, ours, trl_ids, trl_mask, trl_messages):
        assert c.token_ids == ids, key
        assert c.tool_mask == mask, key
        assert c.messages == messages, key
        assert len(c.token_ids) <= budget
    assert sum(v for k, v in counts.items() if k.startswith("calls/")) == trl_calls
    assert sum(v for k, v in counts.items() if k.startswith("failures/")) == trl_failures
    if max_iterations == 10:  # what the script makes of it, by hand
        by_key = dict(zip(SCRIPT, ours))
        assert by_key["E: two rounds"].text == "<answer>7</answer>" and sum(m["role"] == "tool" for m in
                                                                            by_key["E: two rounds"].messages) == 2
        assert by_key["G: a long result"].messages[-1]["role"] == "assistant"  # its result was dropped: too long
        assert len(by_key["H: a long answer"].token_ids) == budget and by_key["H: a long answer"].finish_reason == \
            "length"
        assert [m["content"] for m in by_key["F: sync and async"].messages if m["role"] == "tool"] == ["11", "HI"]
        assert "Tool nope not found." in by_key["C: unknown tool"].messages[1]["content"]
        assert counts["calls/calculate"] == 4 and counts["failures/calculate"] == 1 and counts["failures/broken"] == 1
        for key in ("I: a call without a name", "J: a name that is not a string", "K: a valid and a malformed call"):
            assert len(by_key[key].messages) == 1 and "tool_calls" not in by_key[key].messages[0]  # text: the end
        assert [m["content"] for m in by_key["L: a number written as a string"].messages if m["role"] == "tool"] == \
            ["12"]  # typed by the tool's schema: 7 + 5, not "7" + 5


def test_a_prompt_whose_tool_schemas_the_prompt_budget_cuts_says_so_once(qwen_tokenizer, capsys, monkeypatch):
    """Qwen's template puts the tools' schemas first: a prompt cut from the left to --max-prompt-len loses them
    before anything else, and the agent never sees its tools. That is said once, in one line."""
    import rewards

    monkeypatch.setattr(rewards, "TOOL_CUT_SAID", False, raising=False)
    schemas = [tools.Toolbox([CALC], "").schemas[0]]
    messages = [{"role": "user", "content": "What is 2+3?"}]
    whole = len(rewards.encode_prompt(qwen_tokenizer, messages, 10**6, schemas))
    assert len(rewards.encode_prompt(qwen_tokenizer, messages, whole, schemas)) == whole
    assert capsys.readouterr().err == ""  # a prompt that fits says nothing
    for _ in range(2):
        assert len(rewards.encode_prompt(qwen_tokenizer, messages, whole - 1, schemas)) == whole - 1
    said = capsys.readouterr().err.strip().split("\n")
    assert len(said) == 1 and f"{whole} tokens" in said[0] and "--max-prompt-len" in said[0], said
    rewards.encode_prompt(qwen_tokenizer, [{"role": "user", "content": "x" * 100}], 20)  # no tools: as before
    assert capsys.readouterr().err == ""


# The loop's own rules, on the offline tiny agent's tokenizer (no response_template: <tool_call>{json}</tool_call>)

@pytest.fixture(scope="module")
def agent_path():
    import tiny_agent

    return tiny_agent.cached()


def agent_of(path, tool_specs, environment="", max_calls=0):
    return tools.Agent(tools.Toolbox(tool_specs, environment), models.load_tokenizer(path), max_calls, path, 4096)


def test_bad_arguments_become_the_tools_error_message_and_bad_json_plain_text(agent_path):
    agent = agent_of(agent_path, [CALC])
    script = {"bad json": [['<tool_call>{"name": "calculate", "arguments": {"expression": </tool_call>', "ok"]],
              "bad args": [['<tool_call>{"name": "calculate", "arguments": {"nope": 1}}</tool_call>', "ok"]]}
    examples = [{"messages": [{"role": "user", "content": k}]} for k in script]
    _, groups, counts = agent.rollouts(examples, 1, SamplingParams(max_new_tokens=200), Scripted(agent.tok, script),
                                       512, {})
    bad_json, bad_args = (g[0] for g in groups)
    assert len(bad_json.messages) == 1 and bad_json.tool_mask.count(0) == 0  # plain text, as TRL reads it: the end
    assert "unexpected keyword argument 'nope'" in bad_args.messages[1]["content"]
    assert counts["calls/calculate"] == counts["failures/calculate"] == 1 and bad_args.tool_counts == (1, 1)
    assert bad_args.tool_mask.count(0) > 0 and bad_args.tool_mask[-1] == 1 and len(bad_args.messages) == 3
    metrics = tools.metrics(counts)
    assert metrics["tools/call_frequency"] == 0.5 and metrics["tools/failure_frequency"] == 1.0


def test_the_rollouts_async_calls_run_side_by_side(agent_path):
    """Four rollouts call an async tool that returns only once four calls are running at once (a barrier)."""
    agent = agent_of(agent_path, [FIX + "meet"])
    script = {f"r{i}": [[f'<tool_call>{{"name": "meet", "arguments": {{"who": "r{i}"}}}}</tool_call>', "done"]]
              for i in range(4)}
    examples = [{"messages": [{"role": "user", "content": k}]} for k in script]
    _, groups, counts = agent.rollouts(examples, 1, SamplingParams(max_new_tokens=200), Scripted(agent.tok, script),
                                       512, {})
    assert counts["failures/meet"] == 0 and [g[0].messages[1]["content"] for g in groups] == [f"met r{i}"
                                                                                             for i in range(4)]


def scripted_calls(agent, name, arguments, n=3):
    """n rollouts, each calling tool `name` once with `arguments`, then answering: (their Completions, counts)."""
    script = {f"q{i}": [[f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>', "done"]]
              for i in range(n)}
    examples = [{"messages": [{"role": "user", "content": k}]} for k in script]
    _, groups, counts = agent.rollouts(examples, 1, SamplingParams(max_new_tokens=200), Scripted(agent.tok, script),
                                       512, {})
    return [g[0] for g in groups], counts


def test_a_tool_holding_a_thread_bound_object_works(agent_path):
    """A sqlite3 connection made at import answers only the thread that made it: TRL calls sync tools there."""
    done, counts = scripted_calls(agent_of(agent_path, [FIX + "capital"]), "capital", {"country": "Peru"})
    assert [c.messages[1]["content"] for c in done] == ["Lima"] * 3 and counts["failures/capital"] == 0


@pytest.mark.parametrize("tool", ["hang", "hang_async"])
def test_a_tool_that_never_returns_costs_its_timeout_once_a_round(agent_path, tool):
    import time

    agent = agent_of(agent_path, [FIX + tool])
    agent.timeout = 0.5
    t0 = time.perf_counter()
    done, counts = scripted_calls(agent, tool, {"x": 1})
    assert time.perf_counter() - t0 < 5  # three calls, one limit: the later sync calls fail at once
    assert all(f"{tool} timed out after 0.5 s" in c.messages[1]["content"] for c in done)
    assert counts[f"timeouts/{tool}"] == counts[f"failures/{tool}"] == 3 and all(c.messages[-1]["content"] == "done"
                                                                                 for c in done)


def test_a_list_result_is_passed_as_its_text(agent_path, qwen_tokenizer):
    for tok in (models.load_tokenizer(agent_path), qwen_tokenizer):  # Qwen2.5's template concatenates the content
        agent = tools.Agent(tools.Toolbox([FIX + "digits"]), tok, 0, "agent", 4096)
        done, _ = scripted_calls(agent, "digits", {"n": 305}, n=1)
        assert done[0].messages[1]["content"] == "[3, 0, 5]" and "[3, 0, 5]" in tok.decode(done[0].token_ids)


def test_a_tool_and_a_judge_share_one_event_loop(agent_path):
    """An asyncio.Semaphore made at import, taken by an async tool and by an async judge: one loop for both."""
    from minigdpo.scoring import RewardScorer, close_loop, loop

    try:
        done, counts = scripted_calls(agent_of(agent_path, [FIX + "limited"]), "limited", {"x": 4})
        assert [c.messages[1]["content"] for c in done] == ["8"] * 3
        out, stats = RewardScorer([FIX + "limited_judge"]).score(done, [{"messages": []}] * 3)
        assert out[:, 0].tolist() == [1.0] * 3 and stats[FIX + "limited_judge"]["errors"] == 0
        thread = loop().thread
    finally:
        close_loop()
    assert not thread.is_alive()  # the loop's thread ends with it (a run's or an evaluation's end)


def test_specs_load_from_the_working_folder(tmp_path, monkeypatch):
    (tmp_path / "mytools.py").write_text("def add(a: int, b: int) -> int:\n    \"\"\"Add.\n\n    Args:\n"
                                         "        a: One.\n        b: Two.\n    \"\"\"\n    return a + b\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert tools.Toolbox(["mytools:add"]).tools[0](a=2, b=3) == 5


def test_an_environment_per_rollout_reset_with_its_row_its_methods_as_tools_and_its_reward(agent_path):
    from tests.tool_fixtures import Counter  # the module --environment loads

    agent = agent_of(agent_path, [], FIX + "Counter")
    assert list(agent.box.env_rewards) == ["Counter"] and [s["function"]["name"] for s in agent.box.schemas] == ["increment"]
    script = {"count from": [[f'<tool_call>{{"name": "increment", "arguments": {{"by": {j + 1}}}}}</tool_call>',
                              "done"] for j in range(3)]}
    examples = [{"messages": [{"role": "user", "content": "count from"}], "start": 10, "columns": ("start",)}]
    made = Counter.made
    for step in range(2):  # the pool is made once and reused, each instance reset per rollout
        sampler = Scripted(agent.tok, script)
        shared, groups, _ = agent.rollouts(examples, 3, SamplingParams(max_new_tokens=200), sampler, 512, {})
        assert Counter.made == made + 2  # the probe, and two more for three concurrent rollouts
        assert [e.value for e in agent.environments] == [11, 12, 13] and all(e.resets == step + 1
                                                                             for e in agent.environments)
    assert "(the counter is at 10)" in agent.tok.decode(shared[0])  # reset's string ends the last prompt message
    from minigdpo.scoring import RewardScorer

    scorer = RewardScorer(["tests.tool_fixtures:counted", "Counter"], own=agent.box.env_rewards)
    flat = [c for g in groups for c in g]
    out, _ = scorer([c.text for c in flat], examples * 3, messages=[c.messages for c in flat],
                    environments=agent.environments)
    assert out[:, 0].tolist() == [2.0] * 3 and out[:, 1].tolist() == [11.0, 12.0, 13.0]


def test_prompts_an_environment_makes_differ_share_their_common_part_and_mask_the_rest(agent_path):
    """reset returns another string per instance: the group's prompt is the common part, and each rollout's own rest
    leads its tokens, masked, so the trainer reads each rollout's sequence as the sampler did."""
    agent = agent_of(agent_path, [], FIX + "Counter")
    script = {"count": [["<answer>1</answer>"] for _ in range(2)]}
    sampler = Scripted(agent.tok, script)
    examples = [{"messages": [{"role": "user", "content": "count"}], "start": 0, "columns": ("start",)}]
    agent.box.environments(2)[1].reset = lambda prompt, start, **row: " (at 5)"  # the second differs
    shared, groups, _ = agent.rollouts(examples, 2, SamplingParams(max_new_tokens=50), sampler, 512, {})
    a, b = groups[0]
    assert a.prompt_tokens > 0 and b.prompt_tokens > 0 and a.tool_mask[:a.prompt_tokens] == [0] * a.prompt_tokens
    prompts, _, n = sampler.calls[0]
    assert n == 1 and [shared[0] + c.token_ids for c in (a, b)] == [p + c.token_ids[c.prompt_tokens:]
                                                                    for p, c in zip(prompts, (a, b))]


# train.py and eval.py with the tiny agent ----------------------------------------------------------------------

AGENT = ["--preset", "smoke", "--task", "calculator", "--tools", CALC, "--max-new-tokens", "40", "--max-prompt-len",
         "128", "--group-size", "4", "--batch-size", "16", "--micro-batch-size", "8", "--reward-weights", "1,1,0.5",
         "--dtype", "fp32", "--save-every", "0"]


def hand_gradient(lm, sequences, masked=True):
    """The step's gradient by the textbook formula: token_mean over the global batch of -A * log p (ratio 1, beta 0),
    on full sequences, each token counted where `masked` says the model wrote it (else every completion token)."""
    lm.zero_grad(set_to_none=True)
    tokens = sum(sum(m) if masked else len(m) for _, _, m, *_ in sequences)
    for prompt, completion, mask, adv, *_ in sequences:
        ids = torch.tensor([prompt + completion])
        logp = torch.log_softmax(lm(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
        picked = logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]                     # (T,)
        weight = torch.tensor(mask, dtype=torch.float) if masked else torch.ones(len(completion))
        (-(adv * picked * weight).sum() / tokens).backward()
    return {n: p.grad.clone() for n, p in lm.named_parameters() if p.grad is not None}


def check_gradient(path, out, nproc=1, lora_rank=0):
    seen = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(nproc)]
    sequences = [s for part in seen for s in part["sequences"]]
    assert any(0 in m for _, _, m, *_ in sequences) and any(0 not in m for _, _, m, *_ in sequences)  # tools ran
    lm = models.load_model(path)
    if lora_rank:  # the same adapters, from the run's seed (42), as peft's layers in the plain model
        from minigdpo import lora

        lora.attach(lm, lora.Settings(lora_rank, 8.0, 0.0, ("q_proj", "v_proj"), 42), None)
    want, without_mask = hand_gradient(lm, sequences), hand_gradient(lm, sequences, masked=False)
    got = seen[0]["grads"]
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4)
    assert max((got[n] - without_mask[n]).abs().max().item() for n in want) > 1e-3  # the mask is what made it


@pytest.mark.parametrize("padding_free", ["true", "false"])
def test_the_first_gradient_is_the_hand_computed_one_with_the_tools_tokens_masked(agent_path, tmp_path, padding_free):
    out = str(tmp_path / "step")
    run(["tests/agent_step.py", out, *AGENT, "--model", agent_path, "--max-steps", "1", "--beta", "0", "--loss-agg",
         "token_mean", "--max-grad-norm", "0", "--padding-free", padding_free, "--output-dir", str(tmp_path / "run")])
    check_gradient(agent_path, out)


@pytest.mark.parametrize("flags", [["--lora-rank", "4", "--lora-alpha", "8", "--lora-targets", "q_proj,v_proj"],
                                   ["--compile", "true"]], ids=["lora", "compiled"])
def test_the_mask_holds_with_lora_and_compiled_layers(agent_path, tmp_path, flags):
    out = str(tmp_path / "step")
    run(["tests/agent_step.py", out, *AGENT, "--model", agent_path, "--max-steps", "1", "--beta", "0", "--loss-agg",
         "token_mean", "--max-grad-norm", "0", "--output-dir", str(tmp_path / "run"), *flags], timeout=600)
    check_gradient(agent_path, out, lora_rank=4 if "--lora-rank" in flags else 0)


def test_a_resumed_agent_run_reaches_the_same_weights(agent_path, tmp_path):
    """Two steps straight, and one step, a kill's worth of nothing, then --resume for the second: the same weights
    (the rollouts, their tool calls and masks are made again from the step's seed)."""
    from safetensors.torch import load_file

    common = [*AGENT, "--model", agent_path, "--lr-schedule", "constant"]  # the schedule's length changes below
    args = [*common, "--max-steps", "2", "--save-every", "1"]
    run(["train.py", *args, "--output-dir", str(tmp_path / "straight")])
    run(["train.py", *common, "--max-steps", "1", "--output-dir", str(tmp_path / "resumed")])
    run(["train.py", *args, "--output-dir", str(tmp_path / "resumed"), "--resume"])
    a, b = (load_file(os.path.join(tmp_path, d, "checkpoints", "step_000002", "hf", "model.safetensors"))
            for d in ("straight", "resumed"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = [read_jsonl(os.path.join(tmp_path, d, "metrics.jsonl"))[-1] for d in ("straight", "resumed")]
    assert rows[0]["tools/calculate/calls"] == rows[1]["tools/calculate/calls"] > 0


@pytest.mark.slow
def test_the_first_gradient_on_two_ranks_is_the_hand_computed_one(agent_path, tmp_path):
    out = str(tmp_path / "step")
    run(["tests/agent_step.py", out, *AGENT, "--model", agent_path, "--max-steps", "1", "--beta", "0", "--loss-agg",
         "token_mean", "--max-grad-norm", "0", "--micro-batch-tokens", "200", "--output-dir", str(tmp_path / "run")],
        nproc=2)
    check_gradient(agent_path, out, nproc=2)


def test_train_and_eval_run_the_loop_and_log_what_it_did(agent_path, tmp_path):
    out = str(tmp_path / "run")
    proc = run(["train.py", *AGENT, "--model", agent_path, "--max-steps", "2", "--output-dir", out, "--save-every",
                "2", "--samples-every", "2", "--rewards", "solved,tool_economy", "--reward-weights", "1,0.5"])
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    for r in rows:
        assert 0 < r["tools/call_frequency"] <= 1 and r["tools/failure_frequency"] == 0  # one round of calls at most
        assert r["tools/calculate/calls"] == round(r["tools/call_frequency"] * 16)
        assert 0 < r["tools/token_frac"] < 1 and 1 < r["tools/turns_mean"] <= 2
        assert r["completion/len_max"] <= 40 and r["sampler/logp_gap"] < 1e-5  # the sampler's tokens, trained
        assert {"reward/solved/easy", "reward/tool_economy/calls_hard"} <= set(r)
    sample = read_jsonl(os.path.join(out, "samples.jsonl"))[0]
    assert sample["conversation"][-1]["role"] == "assistant"
    assert "sample at step 2:" in proc.stdout and "  assistant: " in proc.stdout  # one conversation, on the console
    checkpoint = os.path.join(out, "checkpoints", "step_000002")
    import eval as evaluation

    summary = evaluation.main(["--model", checkpoint, "--baseline", agent_path, "--limit", "8", "--n", "2",
                               "--temperature", "1.0", "--output-dir", str(tmp_path / "eval")])  # the run's tools
    model = summary["model"]
    assert model["prompts"] == 8 and 0 < model["tools/call_frequency"] and "accuracy" in model
    assert "reward/answer_tag" not in model and "reward/tool_economy" in model  # the run's --rewards, not the task's
    assert {"tools/call_rate", "tools/call_frequency", "tools/failure_frequency"} <= set(summary["difference"])
    rows = read_jsonl(os.path.join(tmp_path, "eval", "completions.jsonl"))
    assert any(len(r.get("conversation", [])) == 3 for r in rows)


def test_an_environment_through_train_py_is_a_reward_under_gdpo(agent_path, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+1?"}], "start": i}) + "\n"
                            for i in range(8)))
    out = str(tmp_path / "run")
    run(["train.py", *AGENT, "--model", agent_path, "--task", "prompts", "--data", str(data), "--tools", "",
         "--environment", FIX + "Counter", "--rewards", "tests.tool_fixtures:counted,tests.tool_fixtures:prompt_seen",
         "--reward-weights", "1,1,2", "--max-steps", "1", "--output-dir", out])
    (row,) = read_jsonl(os.path.join(out, "metrics.jsonl"))
    assert row["reward/counted/mean"] == 1.0  # each rollout's instance was reset once; named by its function (TRL)
    assert row["reward/prompt_seen/mean"] == 1.0  # the rewards' prompts carry what reset appended, as the model's
    assert 0 <= row["reward/Counter/mean"] <= 8 and "adv/Counter/std" in row


# Bad input: one line each, before any weights load -------------------------------------------------------------

@pytest.mark.parametrize("flags,says", [
    (["--tools", "no_such_module:f"], "--tools 'no_such_module:f': cannot load it"),
    (["--tools", FIX + "no_hints"], "tool tests.tool_fixtures:no_hints: Argument a is missing a type hint"),
    (["--tools", FIX + "no_docstring"], "tool tests.tool_fixtures:no_docstring: Cannot generate JSON schema"),
    (["--environment", FIX + "NoReset"], "NoReset has no reset(**row) method"),
    (["--tools", CALC, "--model", "tiny-random"], "--tools: tiny-random"),
    (["--max-tool-calls", "-1"], "--max-tool-calls must be >= 0"),
    (["--tool-timeout", "0"], "--tool-timeout must be > 0"),
])
def test_bad_agent_input_is_one_line(agent_path, flags, says):
    argv = [*AGENT, "--model", agent_path, *flags]
    assert says in refusal(argv)


def test_tools_with_standard_prompts_are_refused(agent_path, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "What is 1+1?"}) + "\n")
    message = refusal([*AGENT, "--model", agent_path, "--task", "prompts", "--data", str(data), "--rewards",
                       "tests.trl_rewards:answer_in"])
    assert "--tools and --environment need conversational prompts" in message


def test_trl_style_rows_without_task_prompts_name_the_flag(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": [{"role": "user", "content": "What is 1+1?"}], "answer": "2"}) + "\n")
    message = refusal(["--preset", "smoke", "--data", str(data), "--rewards", "tests.trl_rewards:answer_in"])
    assert "pass --task prompts" in message
