"""Rewards with a signal even for a random model, loaded by tests as tests.helpers:NAME."""


def digit_frac(completion, example):
    """Share of characters that are digits: varies across random samples, so advantages are not all 0."""
    return sum(ch.isdigit() for ch in completion) / max(1, len(completion))


def vowel_frac(completion, example):
    return sum(ch in "aeiou" for ch in completion) / max(1, len(completion))
