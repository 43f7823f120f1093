"""Micro-batches cut from flat sequences, as the tests, their torchrun scripts and the benchmarks build them."""

from minigdpo.microbatch import build, by_count


def micro_batches(prompts, completions, advantages, size, pad_id, device, group, layout="padded"):
    """Flat sequences (prompt-major, `group` per prompt: prompts[i] is completion i's prompt) in built micro-batches
    of `size`, as train.py cuts a rank's groups by count."""
    groups = [(prompts[g * group], completions[g * group:(g + 1) * group], advantages[g * group:(g + 1) * group])
              for g in range(len(prompts) // group)]
    return [build(part, pad_id, device, layout) for part in by_count(groups, size)]
