"""TRL-style rewards for the tests (tests/test_own_data.py), loaded as tests.trl_rewards:NAME: each takes TRL's
keyword arguments (rewards/trl_style.py) and checks or uses one part of them."""


def text(completion):
    """A completion's text, in either of TRL's formats."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def prompt_text(prompt):
    return prompt if isinstance(prompt, str) else " ".join(m["content"] for m in prompt)


def row_aligned(prompts, completions, completion_ids, row_id, **kwargs):
    """1.0 where a completion came with its own row (its prompt names its row_id), in the format TRL gives for that
    prompt, with a list of token ids; -1.0 elsewhere. A mean of 1.0 means every argument was aligned."""
    return [1.0 if f"#{r}:" in prompt_text(p) and isinstance(c, str) == isinstance(p, str) and isinstance(ids, list)
            and (isinstance(c, str) or c == [{"role": "assistant", "content": text(c)}]) else -1.0
            for p, c, ids, r in zip(prompts, completions, completion_ids, row_id)]


def answer_in(completions, answer, **kwargs):
    """1.0 if the row's answer appears in the completion; None ("does not apply") for a row without one."""
    return [None if not a else float(a in text(c)) for c, a in zip(completions, answer)]


def scheduled(completions, trainer_state, log_metric, log_extra, **kwargs):
    """A schedule on TRL's trainer_state, a logged metric and a logged column: global_step + a varying part."""
    log_metric("global_step", trainer_state.global_step)
    log_extra("chars", [len(text(c)) for c in completions])
    return [trainer_state.global_step + len(text(c)) % 3 for c in completions]


async def async_length(completion_ids, **kwargs):
    """An async reward, as TRL allows."""
    return [len(ids) / 8 for ids in completion_ids]


def wrong_count(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def not_a_number(completions, **kwargs):
    return ["1.0"] * len(completions)


def overlong(completion_ids, **kwargs):
    """TRL's own soft overlong punishment (DAPO), made by TRL's own factory."""
    from trl.rewards import get_soft_overlong_punishment

    return get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)(completion_ids, **kwargs)


def varied(completions, **kwargs):
    """A reward that differs from completion to completion of a random model (the sum of its characters' codes mod 7):
    groups with something to learn from, so that the weights move (tests/test_async.py)."""
    return [float(sum(map(ord, text(c))) % 7) for c in completions]
