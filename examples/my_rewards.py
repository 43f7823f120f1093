"""Two rewards written for TRL's GRPOTrainer, as a TRL user already has them: minigdpo calls them unchanged.

    python train.py --preset cpu-demo --task prompts --data examples/my_prompts.jsonl \
        --rewards examples.my_rewards:names_the_answer,examples.my_rewards:brief --max-steps 4

Each gets every completion of a batch, by keyword, and the row's columns (here `answer`) as lists aligned with
them; a conversational prompt's completions are [{"role": "assistant", "content": ...}] (rewards/trl_style.py).
"""


def names_the_answer(completions, answer, **kwargs):
    """1 if the completion names the row's answer, else 0."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(a.lower() in t.lower()) for t, a in zip(texts, answer)]


def brief(completion_ids, **kwargs):
    """1 for an answer of at most 8 tokens, falling to 0 at 40."""
    return [min(1.0, max(0.0, (40 - len(ids)) / 32)) for ids in completion_ids]
