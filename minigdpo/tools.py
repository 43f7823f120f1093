"""The tool loop: an agent's rollout over several turns, as TRL 1.16's GRPOTrainer runs one (its `tools=` and
`environment_factory=`; trl/trainer/grpo_trainer.py, _tool_call_loop and _get_tool_suffix_ids).

    --tools mypkg.tools:search,mypkg.tools:fetch     plain functions (or async ones), typed, with Google docstrings
    --environment mypkg.envs:Wordle                  a class; one instance per concurrent rollout, reused

A rollout: the model writes a turn and ends it with its stop token. Its tool calls are parsed (transformers'
parse_response where the tokenizer has a response_template, else the <tool_call>{json}</tool_call> format of
Qwen2.5, Qwen3 and Hermes) and run, each rollout's calls in order and the rollouts' side by side; an exception, an
unknown name or invalid JSON becomes the tool's message, {"error": ...}, and counts as a failure. The tool messages
enter as the chat template's own tokens: what it writes after the assistant's turn for them and for the next
generation prompt (`suffix_ids`). What the model wrote is never encoded again: the trainer sees the sampler's
tokens. The model writes its next turn from those tokens, until a turn calls no tool, --max-tool-calls rounds of
calls, or the budget: --max-new-tokens counts every token after the prompt, the tools' included, and a tool result
that would pass it is dropped, which ends the rollout.

An environment's `reset(**row)` (the row's columns, its prompt included) starts each rollout; a string it returns is
appended to the last prompt message. Its public methods are that rollout's tools, beside --tools; `get_reward()`,
where it has one, is one more reward named after its class (rewards get `environments=` too).

What the trainer gets, a Completion per rollout: every token after its group's prompt, and `tool_mask`, 1 on the
tokens the model wrote, 0 on the tools' and the template's (and on a rollout's own prompt tokens, where an
environment made the G prompts of a group differ: the group's prompt is then their common part). What rewards get:
`messages`, TRL's list (the assistant's message with its tool_calls, the tool messages, ..., the final assistant
message), and `text`, the final message's content.
"""

import asyncio
import importlib
import inspect
import json
import re
from concurrent.futures import ThreadPoolExecutor

from minigdpo.config import ConfigError
from minigdpo.rollout import add_counts, timed
from minigdpo.sampler import Completion, SamplingParams, common_prefix
from rewards import encode_prompt
from rewards.trl_style import EventLoop, columns

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)  # Qwen2.5's, Qwen3's and Hermes' calls


def load(spec, what):
    """The object a `module:name` names; ConfigError in one line where there is none."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{what} {spec!r}: cannot load it ({e})") from None


def schema(fn, name):
    """transformers' JSON schema of a tool, what the chat template renders; ConfigError naming the tool and what it
    lacks where there is none."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ConfigError(f"tool {name}: {str(e).splitlines()[0]} (a tool needs type hints and a Google-style "
                          "docstring with an Args: section)") from None


def methods(env):
    """An environment's tools: its public methods but reset and get_reward, bound to it (read on its class)."""
    return [getattr(env, n) for n, _ in inspect.getmembers(type(env), inspect.isfunction)
            if n not in ("reset", "get_reward") and not n.startswith("_")]


class Toolbox:
    """What --tools and --environment load, checked before any model: the tools, their schemas (what the chat
    template renders), the environments' pool, and `own`: {the environment class's name: its get_reward, a reward
    the run makes}, or {}."""

    def __init__(self, tools, environment=""):
        self.tools = [load(spec, "--tools") for spec in tools]
        self.schemas = [schema(fn, spec) for spec, fn in zip(tools, self.tools)]  # every rollout's: one class of env
        self.factory, self.pool, self.own = None, [], {}
        if environment:
            self.factory = load(environment, "--environment")
            probe = self.factory()  # the pool's first instance
            name, self.pool = type(probe).__name__, [probe]
            if not callable(getattr(probe, "reset", None)):
                raise ConfigError(f"--environment {environment}: {name} has no reset(**row) method")
            self.schemas += [schema(fn, f"{environment}.{fn.__name__}") for fn in methods(probe)]
            self.own = {name: self.reward()} if callable(getattr(probe, "get_reward", None)) else {}

    def environments(self, n):
        """n instances, made once and reused: one per concurrent rollout (TRL's pool)."""
        while len(self.pool) < n:
            self.pool.append(self.factory())
        return self.pool[:n]

    def reward(self):
        """The environments' get_reward as a TRL-style reward, sync or async as get_reward is."""
        if inspect.iscoroutinefunction(type(self.pool[0]).get_reward):
            async def environment_reward(environments, **kwargs):
                return [await e.get_reward() for e in environments]
            return environment_reward
        return lambda environments, **kwargs: [e.get_reward() for e in environments]


class Agent:
    """The tool loop over a batch of rollouts (module docstring), with one tokenizer and one Toolbox."""

    def __init__(self, toolbox, tokenizer, max_calls, model, context):
        self.box, self.tok, self.context = toolbox, tokenizer, context
        self.max_calls = max_calls or float("inf")  # 0: no limit but the budget (TRL's default)
        self.parser = "template" if getattr(tokenizer, "response_template", None) is not None else "json"
        self.threads = ThreadPoolExecutor(max_workers=32, thread_name_prefix="minigdpo-tool")
        self.loop = EventLoop()  # async tools, shared by the rollouts' threads
        self.environments = None  # the last batch's, one per rollout (what rewards get)
        check_template(self, model)

    def tools_of(self, env):  # a rollout's callables: --tools and its environment's methods
        return self.box.tools + (methods(env) if env is not None else [])

    def suffix_ids(self, tool_messages):
        """The template's own tokens after an assistant turn's stop token, for these tool messages and the next
        generation prompt (TRL's _get_tool_suffix_ids: two renderings of a stand-in conversation, subtracted)."""
        call = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
        head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": call}]
        before = self.tok.apply_chat_template(head, tokenize=True, return_dict=False)
        after = self.tok.apply_chat_template(head + tool_messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
        stops = [i for i, t in enumerate(before) if t == self.tok.eos_token_id]
        before = before[:stops[-1] + 1] if stops else before  # up to the turn's end token: "\n" after it is glue
        if after[:len(before)] != before:
            raise ValueError("the chat template does not write earlier messages alike when tool messages follow")
        return after[len(before):]

    def parse(self, ids, prefix, tools):
        """(the assistant's message, errors of calls that could not be read) for one turn's tokens."""
        if self.parser == "template":  # as TRL's parse_response: what cannot be parsed is plain text
            try:
                message = self.tok.parse_response(ids, prefix=prefix, tools=tools)
                message["content"] = (message.get("content") or "").removesuffix(self.tok.eos_token)
                for call in message.get("tool_calls") or []:
                    function = call.setdefault("function", call)
                    function["arguments"] = function.get("arguments") or {}
                return message, []
            except (ValueError, TypeError, AttributeError):
                return {"role": "assistant", "content": self.tok.decode(ids, skip_special_tokens=True)}, []
        text = self.tok.decode(ids, skip_special_tokens=True)
        calls, errors = [], []
        for raw in CALL.findall(text):
            try:
                call = json.loads(raw)
                arguments = call.get("arguments", {})
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
                if not isinstance(call["name"], str) or not isinstance(arguments, dict):
                    raise ValueError("a tool call needs a string name and an object of arguments")
                calls.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                errors.append(f"invalid tool call {raw[:200]!r}: {e}")
        message = {"role": "assistant", "content": CALL.sub("", text).strip()}
        return (message | {"tool_calls": calls} if calls else message), errors

    def call(self, tools, calls, errors):
        """One rollout's calls, in order, as TRL makes them: its tool messages (sync results first, then the async
        ones, then the calls that could not be read) and {name: [calls, failures]}."""
        by_name = {fn.__name__: fn for fn in tools}
        done, waiting = [], []
        for call in calls:
            name = call["function"]["name"]
            try:
                if name not in by_name:
                    raise ValueError(f"Tool {name} not found.")
                result = by_name[name](**call["function"]["arguments"])
                (waiting if inspect.iscoroutine(result) else done).append((name, result, False))
            except Exception as e:
                done.append((name, {"error": str(e)}, True))
        if waiting:
            async def gather():
                return await asyncio.gather(*(c for _, c, _ in waiting), return_exceptions=True)
            done += [(name, {"error": str(r)}, True) if isinstance(r, Exception) else (name, r, False)
                     for (name, *_), r in zip(waiting, self.loop.run(gather()))]
        done += [("unknown", {"error": error}, True) for error in errors]
        counts = add_counts({f"calls/{name}": 1, f"failures/{name}": int(failed)} for name, _, failed in done)
        return [{"role": "tool", "name": n, "content": r if isinstance(r, list) else str(r)} for n, r, _ in done], \
            counts

    def rollouts(self, examples, n, params, sampler, max_prompt_len, seconds):
        """n rollouts of each example: (one prompt per group, their token ids; the groups, n Completions each;
        the loop's counts). Each rollout gets an environment (self.environments, in the groups' order)."""
        N = len(examples) * n
        rows = [ex for ex in examples for _ in range(n)]
        envs = self.box.environments(N) if self.box.factory else [None] * N
        self.environments = envs if self.box.factory else None
        messages = [list(ex["messages"]) for ex in rows]
        for i, (env, row) in enumerate(zip(envs, rows)):
            shown = env.reset(prompt=row["messages"], **{c: row[c] for c in columns(row)}) if env else None
            if isinstance(shown, str):  # TRL: appended to the last prompt message's content
                messages[i][-1] = {**messages[i][-1], "content": messages[i][-1]["content"] + shown}
        own = [encode_prompt(self.tok, m, max_prompt_len, self.box.schemas or None) for m in messages]
        shared = [own[g * n][:common_prefix(own[g * n:(g + 1) * n])] for g in range(len(examples))]
        with timed(seconds, "generate"):
            if all(len(p) == len(shared[i // n]) for i, p in enumerate(own)):
                first = [c for group in sampler.generate(shared, n, params) for c in group]
            else:  # an environment made a group's prompts differ: each its own
                first = [g[0] for g in sampler.generate(own, 1, params)]
        state = [{"ids": [], "mask": [], "logp": [], "messages": [], "turns": 0} for _ in range(N)]
        active, counts = self.extend(state, range(N), first, own), {}
        rounds = 0
        while active and rounds < self.max_calls:
            with timed(seconds, "tools"):
                jobs = [self.threads.submit(self.call, self.tools_of(envs[i]), *state[i].pop("pending"))
                        for i in active]
                results = [job.result() for job in jobs]
            going, counts = [], add_counts([counts] + [used for _, used in results])
            for i, (tool_messages, _) in zip(active, results):
                suffix = self.suffix_ids(tool_messages)
                s = state[i]
                if len(s["ids"]) + len(suffix) > params.max_new_tokens or \
                        len(own[i]) + len(s["ids"]) + len(suffix) >= self.context:
                    continue  # past the budget: the results are dropped and the rollout ends (TRL)
                s["ids"] += suffix
                s["mask"] += [0] * len(suffix)
                s["logp"] += [0.0] * len(suffix)
                s["messages"] += tool_messages
                if len(s["ids"]) < params.max_new_tokens:
                    going.append(i)
            rounds += 1
            if not going:
                break
            turn = SamplingParams(params.temperature, params.top_p, [params.max_new_tokens - len(state[i]["ids"])
                                                                      for i in going],
                                  seed=(params.seed + 1_000_000_009 * rounds) % 2**62, ignore_eos=params.ignore_eos)
            with timed(seconds, "generate"):
                more = [g[0] for g in sampler.generate([own[i] + state[i]["ids"] for i in going], 1, turn)]
            active = self.extend(state, going, more, own)
        groups = [[self.completion(state[i], own[i], len(shared[i // n]), first[i]) for i in range(g * n, (g + 1) * n)]
                  for g in range(len(examples))]
        return shared, groups, counts | {"rollouts": N, "turns": sum(s["turns"] for s in state),
                                         "tool_tokens": sum(len(s["mask"]) - sum(s["mask"]) for s in state),
                                         "tokens": sum(len(s["mask"]) for s in state)}

    def extend(self, state, which, turns, own):
        """Append each rollout's new turn (its tokens, masked 1, and its parsed message); returns the rollouts whose
        turn called a tool, with their calls pending."""
        calling = []
        for i, c in zip(which, turns):
            s = state[i]
            s["last"], s["turns"] = c, s["turns"] + 1
            if not c.token_ids:
                continue
            message, errors = self.parse(c.token_ids, own[i] + s["ids"], self.box.schemas or None)
            s["ids"] += c.token_ids
            s["mask"] += [1] * len(c.token_ids)
            s["logp"] += c.logprobs
            s["messages"].append(message)
            if message.get("tool_calls") or errors:
                s["pending"] = (message.get("tool_calls") or [], errors)
                calling.append(i)
        return calling

    def completion(self, s, own, shared, first):
        """A rollout as the trainer takes it: its own prompt's tail (masked) and every token it added; cut short
        (finish_reason "length") where it ends on tool tokens with no budget left for a turn, as TRL counts it."""
        tail = own[shared:]
        finish = "length" if s["mask"][-1:] == [0] else s.get("last", first).finish_reason
        final = next((m["content"] for m in reversed(s["messages"]) if m["role"] == "assistant"), "")
        return Completion(tail + s["ids"], [0.0] * len(tail) + s["logp"], finish, final,
                          tool_mask=[0] * len(tail) + s["mask"], messages=s["messages"], prompt_tokens=len(tail))


def metrics(counts):
    """A step's tool metrics from every rank's counts (Agent.rollouts): TRL's tools/call_frequency (calls per
    rollout) and tools/failure_frequency (failures per call), the turns per rollout, the tools' and the template's
    share of the tokens after the prompt, and each tool's calls and failures."""
    calls, failures = (sum(v for k, v in counts.items() if k.startswith(f"{kind}/")) for kind in ("calls", "failures"))
    n = max(counts.get("rollouts", 0), 1)
    return {"tools/call_frequency": calls / n, "tools/failure_frequency": failures / max(calls, 1), "tools/turns_mean":
            counts["turns"] / n, "tools/token_frac": counts["tool_tokens"] / max(counts["tokens"], 1)} | {
        f"tools/{k.split('/', 1)[1]}/{k.split('/')[0]}": v for k, v in counts.items() if "/" in k} if counts else {}


def check_template(agent, model):
    """At start, with a stand-in call: the chat template writes a tool-calling conversation (TRL's
    supports_tool_calling), the agent reads the call back from the tokens it writes, and the tool messages' own
    tokens can be cut out of a rendering. ConfigError, naming the model, otherwise."""
    tok = agent.tok
    call = {"type": "function", "function": {"name": "tool_a8f3", "arguments": {"arg_b9d4": "val_d6e7"}}}
    talk = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "tool_a8f3", "content": "content_c4f9"}]
    try:
        text = tok.apply_chat_template(talk, tokenize=False)
        ok = all(s in text for s in ("tool_a8f3", "arg_b9d4", "val_d6e7", "content_c4f9"))
    except Exception:
        ok = False
    if not ok:
        raise ConfigError(f"--tools: the chat template of {model} cannot write a tool-calling conversation (a tool "
                          "call and its result): use a model whose template takes tools")
    prefix = tok.apply_chat_template(talk[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    whole = tok.apply_chat_template(talk[:2], tokenize=True, return_dict=False)
    message, _ = agent.parse(whole[len(prefix):], prefix, None) if whole[:len(prefix)] == prefix else ({}, [])
    if [c["function"] for c in message.get("tool_calls") or []] != [call["function"]]:
        raise ConfigError(f"--tools: the tool calls {model}'s chat template writes cannot be read back: it has no "
                          "response_template, and they are not <tool_call>{json}</tool_call>")
    try:
        agent.suffix_ids(talk[2:])
    except ValueError as e:
        raise ConfigError(f"--tools: {model}: {e}") from None
