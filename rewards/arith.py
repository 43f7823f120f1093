"""The arith task: integer word problems generated offline, scored by the GSM8K rewards.

    Ava has 7 apples. Then Ava finds 3 more. Then the number of apples doubles. How many apples
    does Ava have now?                                                            -> 20

`--arith-difficulty` (1 to 6) sets the number of operations. The training split is 5,000 problems
from one seed; the held-out split comes from another seed and leaves out every problem the
training split has (the easy levels have few distinct problems). With --data, rows in GSM8K's
format are used instead. The CPU demo trains on this task.
"""

import random

from rewards import gsm8k

REWARDS = gsm8k.REWARDS
_NAMES = ["Ava", "Ben", "Cleo", "Dev", "Emma", "Finn", "Gita", "Hugo", "Iris", "Jon"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "shells", "cards", "pencils"]

# One worked example in the answer format: small models follow a shown format far more often
# than a described one, which gives RL a non-zero reward to start from.
SHOT = [{"role": "user", "content": "Mia has 4 shells. Then Mia finds 3 more. How many shells does Mia have now?"},
        {"role": "assistant", "content": "<think>4 + 3 = 7</think>\n<answer>7</answer>"}]


def problem(rng, difficulty):
    """A word problem with `difficulty` operations on small integers; the answer stays >= 0."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    total = rng.randint(2, 9 + 3 * difficulty)
    sentences = [f"{name} has {total} {item}."]
    for _ in range(difficulty):
        op = rng.choice(["gain", "lose", "double"] if total <= 30 else ["gain", "lose"])
        if op == "gain":
            k = rng.randint(1, 5 + 3 * difficulty)
            total += k
            sentences.append(rng.choice([f"Then {name} finds {k} more.", f"A friend gives {name} {k} more."]))
        elif op == "lose" and total > 1:
            k = rng.randint(1, total - 1)
            total -= k
            sentences.append(rng.choice([f"Then {name} gives away {k}.", f"{name} loses {k} of them."]))
        else:
            total *= 2
            sentences.append(f"Then the number of {item} doubles.")
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences), str(total)


def generate(difficulty, count=5000, seed=1234):
    rng = random.Random(seed * 100 + difficulty)
    out = []
    for _ in range(count):
        question, answer = problem(rng, difficulty)
        messages = [{"role": "system", "content": gsm8k.SYSTEM_PROMPT}, *SHOT, {"role": "user", "content": question}]
        out.append({"messages": messages, "answer": answer})
    return out


def examples(data, split, skip_bad, settings):
    if data:
        return gsm8k.examples(data, split, skip_bad, settings)
    difficulty = settings.get("arith_difficulty", 2)
    found = generate(difficulty, seed=1234 if split == "train" else 4321)
    if split != "train":  # keep the held-out problems truly unseen
        seen = {ex["messages"][-1]["content"] for ex in generate(difficulty, seed=1234)}
        found = [ex for ex in found if ex["messages"][-1]["content"] not in seen]
    return found, 0
