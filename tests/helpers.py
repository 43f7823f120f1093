"""Rewards with a signal even for a random model, loaded by tests as tests.helpers:NAME."""


def digit_frac(completion, example):
    """Share of characters that are digits: varies across random samples, so advantages are not all 0."""
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


def vowel_frac(completion, example):
    return sum(ch in "aeiou" for ch in completion) / max(1, len(completion))


def raises(completion, example):
    raise RuntimeError("reward bug")


def nan_or_inf(completion, example):
    return float("nan") if len(completion) % 2 else float("inf")


def text(completion, example):
    return "1.0"


def hangs(completion, example):
    import time

    while True:
        time.sleep(1)


def never_applies(completion, example):
    return None


# The range of values each built-in reward may return (its docstring's table): the fuzz and adversarial
# tests check every value against it.
RANGES = {"format": (0.0, 1.0), "correct": (0.0, 1.0), "integer": (0.0, 1.0), "length_ok": (0.0, 1.0),
          "tool_format": (0.0, 1.0), "tool_format_strict": (0.0, 1.0), "tool_correct": (-3.0, 3.0),
          "pass": (0.0, 1.0), "no_bug": (0.0, 1.0), "solved": (0.0, 1.0), "answer_tag": (0.0, 1.0),
          "tool_economy": (0.0, 1.0)}


def odd_answers_only(completion, example):
    """A signal only on problems with an odd answer: elsewhere every completion gets the same 1.0, so
    those groups carry nothing (informative_groups drops them under --dynamic-sampling)."""
    return sum(map(ord, completion)) % 97 / 97 if int(example["answer"]) % 2 else 1.0


def constant(completion, example):
    return 1.0


_SCORED = [0]


def constant_first_step(completion, example):
    """1.0 for the first 8 samples this process scores (the smoke preset's first step on one rank: nothing to
    learn), then a value that differs between completions: the step after a skipped update has a signal again."""
    _SCORED[0] += 1
    return 1.0 if _SCORED[0] <= 8 else sum(map(ord, completion)) % 97 / 97


_calls = {"scored": 0}


def dies_on_rank2(completion, example):
    """digit_frac, until world rank 2 has scored 16 completions: then that process exits at once, as a crashed rank
    would (tests/test_split.py: a sampling rank that dies)."""
    import os

    _calls["scored"] += 1
    if os.environ.get("RANK") == "2" and _calls["scored"] > 16:
        os._exit(1)
    return digit_frac(completion, example)


class Echo:
    """A sampler for EngineProcess's test (tests/test_split.py): it answers where it runs and what it was sent."""

    adapters_only = False

    def __init__(self, scale, fail=False):
        if fail:
            raise ValueError("a setting this sampler refuses")
        self.scale, self.loaded = scale, []

    def load_weights(self, named_tensors):
        self.loaded = [(name, tensor.sum().item()) for name, tensor in named_tensors]

    def generate(self, prompts, n):
        import os

        return [[p * self.scale] * n for p in prompts], os.getpid(), os.environ.get("RANK"), self.loaded

    def close(self):
        pass

    def exit(self):
        import os

        os._exit(3)
