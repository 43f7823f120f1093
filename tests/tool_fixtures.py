"""Tools, environments and a scripted sampler for the tool loop's tests (tests/test_tools.py), loaded by name
(--tools tests.tool_fixtures:NAME, --environment tests.tool_fixtures:NAME)."""

import asyncio
import sqlite3
import threading

from minigdpo.sampler import Completion


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def shout(text: str) -> str:
    """Say it louder, later.

    Args:
        text: What to say.
    """
    await asyncio.sleep(0)
    return text.upper()


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken on {x}")


MEETING = asyncio.Barrier(4)  # made at import, outside any loop, as a rate limit or a client is


async def meet(who: str) -> str:
    """Waits until four callers have come: only calls that run side by side return.

    Args:
        who: The caller.
    """
    await asyncio.wait_for(MEETING.wait(), 20)
    return f"met {who}"


DATABASE = sqlite3.connect(":memory:")  # made at import, in the main thread: sqlite3 refuses any other thread
DATABASE.execute("CREATE TABLE capitals (country TEXT, city TEXT)")
DATABASE.execute("INSERT INTO capitals VALUES ('France', 'Paris'), ('Peru', 'Lima')")


def capital(country: str) -> str:
    """The capital of a country, from a database.

    Args:
        country: The country.
    """
    row = DATABASE.execute("SELECT city FROM capitals WHERE country = ?", (country,)).fetchone()
    return row[0] if row else "unknown"


def hang(x: int) -> int:
    """Never returns.

    Args:
        x: Anything.
    """
    threading.Event().wait()


async def hang_async(x: int) -> int:
    """Never returns either.

    Args:
        x: Anything.
    """
    await asyncio.Event().wait()


def digits(n: int) -> list:
    """The digits of a number, as a list.

    Args:
        n: The number.
    """
    return [int(d) for d in str(n)]


LIMIT = asyncio.Semaphore(1)  # one API's rate limit, shared by a tool and a judge


async def limited(x: int) -> int:
    """Doubles, under the shared rate limit.

    Args:
        x: The number.
    """
    async with LIMIT:
        await asyncio.sleep(0)
        return 2 * x


async def limited_judge(completions, **kwargs):
    """A TRL-style async judge under the same rate limit as the `limited` tool."""
    async def one(c):
        async with LIMIT:
            await asyncio.sleep(0)
            return 1.0
    return await asyncio.gather(*(one(c) for c in completions))


def prompt_seen(prompts, **kwargs):
    """A TRL-style reward that reads the prompt: 1 where its last message carries what the environment appended."""
    return [float("(the counter is at" in p[-1]["content"]) for p in prompts]


def no_hints(a, b):
    """Add.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


class Counter:
    """An environment: a counter each rollout starts from the row's `start`, tools to move it, and a reward."""

    made = 0

    def __init__(self):
        Counter.made += 1
        self.value, self.resets = 0, 0

    def reset(self, prompt, start, **row):
        self.value, self.resets = int(start), self.resets + 1
        return f" (the counter is at {self.value})"

    def increment(self, by: int) -> int:
        """Move the counter up.

        Args:
            by: How far.
        """
        self.value += by
        return self.value

    def get_reward(self):
        return float(self.value)

    def _hidden(self):
        return "not a tool"


class NoReset:
    def step(self, x: int) -> int:
        """A step.

        Args:
            x: Anything.
        """
        return x


def counted(completions, environments, **kwargs):
    """A TRL-style reward that reads each rollout's environment (TRL passes environments=)."""
    return [float(e.resets) for e in environments]


class Scripted:
    """A sampler that writes scripted turns. script[key]: for the rollouts whose prompt holds `key`, one list of turns
    (texts) per sample of the group, each turn ending with <|im_end|> unless its limit cuts it first; a rollout's
    later turns are found by the tokens it started with. Records every call's prompts (token ids) and limits."""

    def __init__(self, tokenizer, script):
        self.tok, self.script, self.calls, self.started = tokenizer, script, [], []
        self.stop = tokenizer.eos_token_id

    def turn(self, text, limit):
        ids = (self.tok(text, add_special_tokens=False).input_ids + [self.stop])[:limit]
        return Completion(ids, [-0.5] * len(ids), "stop" if ids[-1] == self.stop else "length",
                          self.tok.decode(ids, skip_special_tokens=True))

    def generate(self, prompts, n, params):
        limits = params.max_new_tokens
        limits = limits if isinstance(limits, list) else [limits] * len(prompts)
        self.calls.append((prompts, limits, n))
        out = []
        for prompt, limit in zip(prompts, limits):
            started = [s for s in self.started if prompt[:len(s["ids"])] == s["ids"]]
            if started:  # a later turn of a rollout
                s = max(started, key=lambda s: len(s["ids"]))
                s["turn"] += 1
                out.append([self.turn(self.script[s["key"]][s["j"]][s["turn"]], limit)])
                continue
            key = next(k for k in self.script if k in self.tok.decode(prompt))
            group = [self.turn(self.script[key][j][0], limit) for j in range(n)]
            self.started += [{"ids": prompt + c.token_ids, "key": key, "j": j, "turn": 0} for j, c in enumerate(group)]
            out.append(group)
        return out
