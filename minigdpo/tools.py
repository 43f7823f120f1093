"""The tool loop: an agent's rollout over several turns, as TRL 1.16's GRPOTrainer runs one (its `tools=` and
`environment_factory=`; trl/trainer/grpo_trainer.py, _tool_call_loop and _get_tool_suffix_ids).

    --tools mypkg.tools:search,mypkg.tools:fetch     plain functions (or async ones), typed, with Google docstrings
    --environment mypkg.envs:Wordle                  a class; one instance per concurrent rollout, reused

A rollout: the model writes a turn; it is parsed as its family writes tool calls (minigdpo/chat_formats.py), its
calls run in order, and their results enter as the chat template's own tokens (chat_formats.suffix_ids): what the
model wrote is never encoded again. The trainer gets `tool_mask` (1 where the model wrote), the rewards TRL's
`messages`. docs/tasks.md, "Agents: tools over several turns", tells the whole of it: when a rollout ends, failures
and time limits, async tools, environments, what rewards see.
"""

import asyncio
import inspect

from minigdpo import chat_formats, scoring
from minigdpo.config import ConfigError
from minigdpo.rollout import add_counts, timed
from minigdpo.sampler import Completion, SamplingParams, common_prefix
from rewards import encode_prompt, load_object
from rewards.trl_style import columns


def load(spec, what):
    """The object a `module:name` names (from the working folder too); ConfigError in one line where there is none."""
    try:
        return load_object(spec)
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
    template renders), the environments' pool, and `env_rewards`: {the environment class's name: its get_reward, a
    reward the run makes}, or {}."""

    def __init__(self, tools, environment=""):
        self.tools = [load(spec, "--tools") for spec in tools]
        self.schemas = [schema(fn, spec) for spec, fn in zip(tools, self.tools)]  # every rollout's: one class of env
        self.factory, self.pool, self.env_rewards = None, [], {}
        if environment:
            self.factory = load(environment, "--environment")
            probe = self.factory()  # the pool's first instance
            name, self.pool = type(probe).__name__, [probe]
            if not callable(getattr(probe, "reset", None)):
                raise ConfigError(f"--environment {environment}: {name} has no reset(**row) method")
            self.schemas += [schema(fn, f"{environment}.{fn.__name__}") for fn in methods(probe)]
            self.env_rewards = {name: self.reward()} if callable(getattr(probe, "get_reward", None)) else {}

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
    """The tool loop over a batch of rollouts (module docstring), with one tokenizer and one Toolbox. After each
    batch, `prompts` and `environments` hold each rollout's prompt messages (as reset left them) and environment, in
    the groups' order: what the rewards get."""

    def __init__(self, toolbox, tokenizer, max_calls, model, context, timeout=60.0):
        self.box, self.tok, self.context, self.timeout = toolbox, tokenizer, context, timeout
        self.max_calls = max_calls or float("inf")  # 0: no limit but the budget (TRL's default)
        try:
            self.format = chat_formats.check(tokenizer, model)  # how this family writes a call: a response_template
        except chat_formats.TemplateError as e:
            raise ConfigError(f"--tools: {e}") from None
        self.prompts, self.environments = None, None

    def tools_of(self, env):  # a rollout's callables: --tools and its environment's methods
        return self.box.tools + (methods(env) if env is not None else [])

    def call(self, rollouts):
        """Each rollout's calls, [(tools, calls)], in order: its tool messages (TRL's order: the sync results, then
        the async ones) and each call's (name, "" or "failures" or "timeouts"). A sync tool runs here, in the calling
        thread, under the time limit; once one has timed out in this round its later calls fail at once, so a tool
        that never returns costs one limit a round. The async calls of every rollout run together on the event loop."""
        done, waiting, hung = [[] for _ in rollouts], [], set()
        for i, (tools, calls) in enumerate(rollouts):
            by_name = {fn.__name__: fn for fn in tools}
            for call in calls:
                name = call["function"]["name"]
                try:
                    if name not in by_name:
                        raise ValueError(f"Tool {name} not found.")
                    if name in hung:
                        raise scoring.TimeUp
                    with scoring.time_limit(self.timeout):
                        result = by_name[name](**call["function"]["arguments"])
                    if inspect.iscoroutine(result):
                        waiting.append((i, name, result))
                    else:
                        done[i].append((name, result, ""))
                except scoring.TimeUp:
                    hung.add(name)
                    done[i].append((name, {"error": f"{name} timed out after {self.timeout:g} s"}, "timeouts"))
                except Exception as e:
                    done[i].append((name, {"error": str(e)}, "failures"))
        if waiting:
            for (i, name, _), r in zip(waiting, scoring.loop().run(self.gather([c for *_, c in waiting]))):
                timed_out = isinstance(r, asyncio.TimeoutError)
                failed = {"error": f"{name} timed out after {self.timeout:g} s" if timed_out else str(r)}
                done[i].append((name, failed, "timeouts" if timed_out else "failures") if isinstance(r, BaseException)
                               else (name, r, ""))
        return [[{"role": "tool", "name": name, "content": r if isinstance(r, str) else str(r)} for name, r, _ in part]
                for part in done], [[(name, kind) for name, _, kind in part] for part in done]

    async def gather(self, coroutines):
        """The async calls side by side, each under the time limit; exceptions returned, not raised."""
        return await asyncio.gather(*(asyncio.wait_for(c, self.timeout or None) for c in coroutines),
                                    return_exceptions=True)

    def rollouts(self, examples, n, params, sampler, max_prompt_len, seconds):
        """n rollouts of each example: (one prompt per group, their token ids; the groups, n Completions each;
        the loop's counts). Each rollout gets an environment (self.environments, in the groups' order)."""
        N = len(examples) * n
        rows = [ex for ex in examples for _ in range(n)]
        envs = self.box.environments(N) if self.box.factory else [None] * N
        self.environments = envs if self.box.factory else None
        self.prompts = [list(ex["messages"]) for ex in rows]
        for i, (env, row) in enumerate(zip(envs, rows)):
            shown = env.reset(prompt=row["messages"], **{c: row[c] for c in columns(row)}) if env else None
            if isinstance(shown, str):  # TRL: appended to the last prompt message's content
                self.prompts[i][-1] = {**self.prompts[i][-1], "content": self.prompts[i][-1]["content"] + shown}
        prompt_ids = [encode_prompt(self.tok, m, max_prompt_len, self.box.schemas or None) for m in self.prompts]
        shared = [prompt_ids[g * n][:common_prefix(prompt_ids[g * n:(g + 1) * n])] for g in range(len(examples))]
        with timed(seconds, "generate"):
            if all(len(p) == len(shared[i // n]) for i, p in enumerate(prompt_ids)):
                first_turns = [c for group in sampler.generate(shared, n, params) for c in group]
            else:  # an environment made a group's prompts differ: each its own
                first_turns = [g[0] for g in sampler.generate(prompt_ids, 1, params)]
        state = [{"ids": [], "mask": [], "logp": [], "messages": [], "turns": 0, "calls": 0, "failed": 0}
                 for _ in range(N)]
        active, counts = self.extend(state, range(N), first_turns, prompt_ids), {}
        rounds = 0
        while active and rounds < self.max_calls:
            with timed(seconds, "tools"):
                results, kinds = self.call([(self.tools_of(envs[i]), state[i].pop("pending")) for i in active])
            going, counts = [], add_counts([counts] + [{f"calls/{name}": 1, f"failures/{name}": int(bool(kind)),
                                                        f"timeouts/{name}": int(kind == "timeouts")}
                                                       for part in kinds for name, kind in part])
            for i, tool_messages, part in zip(active, results, kinds):
                s = state[i]
                s["calls"] += len(part)  # made, whether or not their results fit the budget (TRL counts them)
                s["failed"] += sum(bool(kind) for _, kind in part)
                suffix = chat_formats.suffix_ids(self.tok, tool_messages)
                if len(s["ids"]) + len(suffix) > params.max_new_tokens or \
                        len(prompt_ids[i]) + len(s["ids"]) + len(suffix) >= self.context:
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
                more = [g[0] for g in sampler.generate([prompt_ids[i] + state[i]["ids"] for i in going], 1, turn)]
            active = self.extend(state, going, more, prompt_ids)
        groups = [[self.completion(state[i], prompt_ids[i], len(shared[i // n]), first_turns[i])
                   for i in range(g * n, (g + 1) * n)] for g in range(len(examples))]
        return shared, groups, counts | {"rollouts": N, "turns": sum(s["turns"] for s in state),
                                         "tool_tokens": sum(len(s["mask"]) - sum(s["mask"]) for s in state),
                                         "tokens": sum(len(s["mask"]) for s in state)}

    def extend(self, state, which, turns, prompt_ids):
        """Append each rollout's new turn (its tokens, masked 1, and its parsed message); returns the rollouts whose
        turn called a tool, with their calls pending."""
        calling = []
        for i, c in zip(which, turns):
            s = state[i]
            s["last"], s["turns"] = c, s["turns"] + 1
            if not c.token_ids:
                continue
            message = chat_formats.parse(self.tok, self.format, c.token_ids, prompt_ids[i] + s["ids"],
                                         self.box.schemas or None)
            s["ids"] += c.token_ids
            s["mask"] += [1] * len(c.token_ids)
            s["logp"] += c.logprobs
            s["messages"].append(message)
            if message.get("tool_calls"):
                s["pending"] = message["tool_calls"]
                calling.append(i)
        return calling

    def completion(self, s, prompt_ids, shared, first_turn):
        """A rollout as the trainer takes it: its own prompt's tail (masked) and every token it added; cut short
        (finish_reason "length") where it ends on tool tokens with no budget left for a turn, as TRL counts it."""
        tail = prompt_ids[shared:]
        finish = "length" if s["mask"][-1:] == [0] else s.get("last", first_turn).finish_reason
        final = next((m["content"] for m in reversed(s["messages"]) if m["role"] == "assistant"), "")
        return Completion(tail + s["ids"], [0.0] * len(tail) + s["logp"], finish, final,
                          tool_mask=[0] * len(tail) + s["mask"], messages=s["messages"], prompt_tokens=len(tail),
                          tool_counts=(s["calls"], s["failed"]))


def metrics(counts):
    """A step's tool metrics from every rank's counts (Agent.rollouts): TRL's tools/call_frequency (calls per
    rollout) and tools/failure_frequency (failures per call), the turns per rollout, the tools' and the template's
    share of the tokens after the prompt, and each tool's calls, failures and timeouts."""
    calls, failures = (sum(v for k, v in counts.items() if k.startswith(f"{kind}/")) for kind in ("calls", "failures"))
    n = max(counts.get("rollouts", 0), 1)
    return {"tools/call_frequency": calls / n, "tools/failure_frequency": failures / max(calls, 1), "tools/turns_mean":
            counts["turns"] / n, "tools/token_frac": counts["tool_tokens"] / max(counts["tokens"], 1)} | {
        f"tools/{k.split('/', 1)[1]}/{k.split('/')[0]}": v for k, v in counts.items() if "/" in k} if counts else {}
