"""The same TRL-style reward functions through TRL 1.16's GRPOTrainer._calculate_rewards and through minigdpo's
RewardScorer, on the same rows and completions, in both prompt formats (tests/test_own_data.py compares them).

    python tests/trl_rewards_oracle.py WORK     # prints {"standard": {"trl": [[...]], "mini": [[...]]}, ...}

TRL is a test-time oracle only; the package never imports it. G = 2 completions for each of 4 rows.
"""

import json
import os
import sys

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from test_own_data import prompts_file  # noqa: E402

NAMES = ["tests.trl_rewards:row_aligned", "tests.trl_rewards:answer_in", "tests.trl_rewards:scheduled",
         "tests.trl_rewards:async_length", "tests.trl_rewards:overlong"]
TEXTS = ["a", "the word b", "", "c c c", "abc", "x", "b!", "nothing"]  # 2 per row, in row order
G = 2


def main(work):
    import importlib

    from datasets import Dataset
    from transformers import TrainerState
    from trl import GRPOConfig, GRPOTrainer

    from minigdpo import models
    from minigdpo.scoring import RewardScorer
    from rewards import load_task

    path = models.resolve_model("tiny-random")
    tok = models.load_tokenizer(path)
    ids = [tok(t, add_special_tokens=False).input_ids for t in TEXTS]
    out = {}
    for fmt, conversational in (("standard", False), ("conversational", True)):
        data = prompts_file(os.path.join(work, f"{fmt}.jsonl"), conversational, rows=4)
        rows = [json.loads(line) for line in open(data)]
        fns = [getattr(importlib.import_module(n.split(":")[0]), n.split(":")[1]) for n in NAMES]
        args = GRPOConfig(output_dir=os.path.join(work, "trl"), use_cpu=True, bf16=False, num_generations=G,
                          per_device_train_batch_size=G * len(rows), max_completion_length=8, report_to="none",
                          save_strategy="no", disable_tqdm=True, model_init_kwargs={"dtype": torch.float32})
        trainer = GRPOTrainer(model=path, reward_funcs=fns, args=args, train_dataset=Dataset.from_list(rows),
                              processing_class=tok)
        inputs = [row for row in rows for _ in range(G)]  # TRL's RepeatSampler: each row G times in a row
        completions = [[{"role": "assistant", "content": t}] if conversational else t for t in TEXTS]
        trl = trainer._calculate_rewards(inputs, [r["prompt"] for r in inputs], completions, ids)
        examples = [ex for ex in load_task("prompts", data, "train").examples for _ in range(G)]
        scorer = RewardScorer(NAMES)
        scorer.trainer_state = TrainerState(global_step=0, max_steps=1)
        mini, stats = scorer(TEXTS, examples, completion_ids=ids)
        out[fmt] = {"trl": [[None if v != v else v for v in row] for row in trl.tolist()],
                    "mini": [[None if v != v else v for v in row] for row in mini.tolist()]}
        assert not any(s["errors"] for s in stats.values()), stats
    print(json.dumps(out))


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    main(sys.argv[1])
