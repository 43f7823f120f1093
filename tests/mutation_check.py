"""Plant realistic one-line bugs, one at a time, and check that the tests catch each.

    python tests/mutation_check.py             # every mutation (about 20 minutes on 2 cores)
    python tests/mutation_check.py -k clip     # those whose name contains "clip"
    python tests/mutation_check.py --list      # the mutations, without running anything

For each mutation the script copies the repository (the files git tracks, as they are in the work tree)
into a temporary directory, replaces one exact piece of one file (it must occur exactly once), runs the
test files that cover that code with `pytest -x`, and prints "caught" when a test fails and "missed" when
they all pass. First it runs each of those test selections once on the unchanged copy: they must pass
there, or a "caught" would mean nothing. The exit status is 1 if any mutation was missed. pytest does not collect this file (its
name does not start with test_); the suite itself never runs it.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Mutation:
    name: str
    path: str     # file, relative to the repository
    old: str      # an exact piece of it, which must occur once
    new: str
    tests: tuple  # pytest arguments: files, node ids, -k expressions


MUTATIONS = [
    # The three that once passed every test.
    Mutation("update: the trainer's log-probs at temperature 1 (the sampler still samples at --temperature)",
             "minigdpo/update.py", "model(mb, cfg.temperature, cfg.logprob_chunk, entropy=True)",
             "model(mb, 1.0, cfg.logprob_chunk, entropy=True)",
             ("tests/test_train.py", "-k", "test_smoke_run and 1")),
    Mutation("update: gradient clipping computes the norm but does not scale the gradients",
             "minigdpo/update.py", "norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf)",
             "norm = torch.nn.utils.get_total_norm([p.grad for p in params])",
             ("tests/test_policy.py", "tests/test_lora.py")),
    Mutation("rewards: the GSM8K format reward closes a completion cut off before </answer>",
             "rewards/gsm8k.py", "def format_reward(completion, example):\n",
             'def format_reward(completion, example):\n    completion += "" if "</answer>" in completion else "</answer>"\n',
             ("tests/test_rewards.py", "tests/test_fuzz.py", "tests/test_tasks.py")),
    # Advantages.
    Mutation("advantages: GDPO's batch step (Eq. 6) dropped",
             "minigdpo/advantages.py", "a = (a_sum - flat.mean()) / (flat.std() + eps)", "a = a_sum",
             ("tests/test_advantages.py",)),
    Mutation("advantages: the batch std without Bessel's correction",
             "minigdpo/advantages.py", "a = (a_sum - flat.mean()) / (flat.std() + eps)",
             "a = (a_sum - flat.mean()) / (flat.std(unbiased=False) + eps)", ("tests/test_advantages.py",)),
    Mutation("advantages: the group std without Bessel's correction",
             "minigdpo/advantages.py", "var = dev.pow(2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)",
             "var = dev.pow(2).sum(dim=1, keepdim=True) / n.clamp(min=1)", ("tests/test_advantages.py",)),
    Mutation("advantages: GDPO's reward weights (Eq. 7) ignored",
             "minigdpo/advantages.py", "return (a_k * weights_of(rewards, weights)).sum(dim=-1)", "return a_k.sum(dim=-1)",
             ("tests/test_advantages.py",)),
    Mutation("advantages: the eps inside the square root",
             "minigdpo/advantages.py", "z = dev / (var.sqrt() + eps)", "z = dev / (var + eps).sqrt()",
             ("tests/test_advantages.py",)),
    Mutation("advantages: dynamic sampling asks GRPO's question (the summed reward) for GDPO too",
             "minigdpo/estimators.py", "return grpo(r, w) if r.shape[-1] == 1 else gdpo_group(r, w)",
             "return grpo(r, w)", ("tests/test_dynamic_sampling.py", "-m", "not slow")),
    # The loss.
    Mutation("loss: k1 in place of the k3 KL estimator",
             "minigdpo/update.py", "kl = torch.exp(delta) - delta - 1", "kl = -delta", ("tests/test_loss.py",)),
    Mutation("loss: the clip bounds swapped",
             "minigdpo/update.py", "torch.clamp(ratio, 1 - clip_low, 1 + clip_high)",
             "torch.clamp(ratio, 1 - clip_high, 1 + clip_low)", ("tests/test_loss.py",)),
    Mutation("loss: max in place of min in the clipped surrogate",
             "minigdpo/update.py", "pg = -torch.min(ratio * adv, clipped * adv)", "pg = -torch.max(ratio * adv, clipped * adv)",
             ("tests/test_loss.py",)),
    Mutation("loss: token_mean divides by the micro-batch's tokens, not the batch's",
             "minigdpo/update.py", '"token_mean": tokens,', '"token_mean": 1.0,',
             ("tests/test_trl_oracle.py",)),
    Mutation("loss: bnpo forgets the number of micro-batches",
             "minigdpo/update.py", '"micro_batch_token_mean": micro,', '"micro_batch_token_mean": 1,',
             ("tests/test_trl_oracle.py",)),
    # The log-probs, the optimizer and its schedule.
    Mutation("logprobs: the chunked log-probs ignore the temperature",
             "minigdpo/logprobs.py", "            if temperature != 1.0:\n                logits.div_(temperature)\n",
             "", ("tests/test_policy.py",)),
    Mutation("update: the learning-rate warmup off by one step",
             "minigdpo/update.py", "return (step + 1) / warmup", "return step / warmup", ("tests/test_policy.py",)),
    Mutation("update: weight decay on biases and normalisation weights too",
             "minigdpo/update.py", "(no_decay if NO_DECAY.search(name.lower()) or id(p) in in_layernorm else decay)",
             "decay", ("tests/test_policy.py",)),
    # The training loop.
    Mutation("update: padding counted as completion tokens in the mask",
             "minigdpo/microbatch.py", "mask[row, :lengths[row]] = float(counted)",
             "mask[row, :] = float(counted)", ("tests/test_policy.py", "tests/test_one_file.py")),
    Mutation("train: the reference log-probs taken from the policy",
             "train.py", 'fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)',
             'fill_logprobs(model, batches, "ref_logp", cfg)', ("tests/test_train.py", "-k", "test_smoke_run and 1")),
    Mutation("train: the data cursor not restored on resume",
             "train.py", 'start, cursor, pending = state["step"], state["cursor"]',
             'start, cursor, pending = state["step"], 0',
             ("tests/test_train.py", "-k", "resume")),
    # Checkpoints.
    Mutation("checkpoint: resume takes a step directory without COMPLETE",
             "minigdpo/checkpoint.py", 'if m and os.path.exists(os.path.join(base, name, "COMPLETE")):', "if m:",
             ("tests/test_policy.py", "-k", "partial")),
    Mutation("checkpoint: a checkpoint missing another rank's files marked complete",
             "minigdpo/checkpoint.py", "            if lacking:\n                raise NotWhole(", "            if False:\n                raise NotWhole(",
             ("tests/test_cluster.py", "-k", "missing_another")),
    # The sampler.
    Mutation("sampler: the HF sampler samples at temperature 1",
             "minigdpo/sampler.py", "logits = logits / params.temperature", "logits = logits", ("tests/test_policy.py",)),
    Mutation("sampler: the HF sampler never stops at a stop token",
             "minigdpo/sampler.py", "stopped = ~done & torch.isin(tok, self.stop_ids)", "stopped = ~done & (tok < 0)",
             ("tests/test_policy.py",)),
    # Rewards and config.
    Mutation("rewards: correct accepts any answer the gold answer contains",
             "rewards/gsm8k.py", "return 1.0 if _drop_separators(predicted) == _drop_separators(gold) else 0.0",
             "return 1.0 if predicted in gold else 0.0", ("tests/test_rewards.py",)),
    Mutation('config: "3.0" accepted as an integer',
             "minigdpo/cli.py", "group.add_argument(flag, type=f.type, default=None,",
             "group.add_argument(flag, type=(lambda x: int(float(x))) if f.type is int else f.type, default=None,",
             ("tests/test_reliability.py", "-k", "integer_flag")),
]


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [f for f in out.split("\0") if f and os.path.exists(os.path.join(ROOT, f))]


def copy_repo(dst):
    for f in tracked_files():
        os.makedirs(os.path.dirname(os.path.join(dst, f)) or dst, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))


def check(m, timeout, mutate=True):
    """(verdict, seconds): "caught", "missed", or "error: ..." when the mutation does not apply.
    mutate=False runs the tests on the unchanged copy (they must pass: "missed")."""
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        copy_repo(tmp)
        path = os.path.join(tmp, m.path)
        text = open(path).read()
        if text.count(m.old) != 1:
            return f"error: the piece occurs {text.count(m.old)} times in {m.path}", 0.0
        if mutate:
            with open(path, "w") as f:
                f.write(text.replace(m.old, m.new))
        env = {**os.environ, "PYTHONPATH": tmp, "PYTHONDONTWRITEBYTECODE": "1"}
        t0 = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *m.tests],
                                  cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "caught (timed out)", time.monotonic() - t0
        seconds = time.monotonic() - t0
        if proc.returncode == 0:
            return "missed", seconds
        if proc.returncode in (1,):  # a test failed
            return "caught", seconds
        return f"error: pytest exited {proc.returncode}\n{proc.stdout[-1500:]}", seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-k", default="", help="run only the mutations whose name contains this")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutation's tests")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    if args.list:
        print("\n".join(f"{m.name}  [{m.path}; {' '.join(m.tests)}]" for m in chosen))
        return 0
    os.environ.setdefault("MINIGDPO_CACHE", tempfile.mkdtemp(prefix="mutant-cache-"))  # tiny-random built once
    for tests in dict.fromkeys(m.tests for m in chosen):  # the control: each selection passes unmutated
        m = next(m for m in chosen if m.tests == tests)
        verdict, seconds = check(m, args.timeout, mutate=False)
        if verdict != "missed":
            print(f"error: {' '.join(tests)} does not pass on the unchanged repository ({verdict.splitlines()[0]})")
            return 1
        print(f"control  {seconds:6.1f} s  {' '.join(tests)} passes unchanged", flush=True)
    missed = 0
    for m in chosen:
        verdict, seconds = check(m, args.timeout)
        missed += verdict != "caught" and not verdict.startswith("caught")
        print(f"{verdict.splitlines()[0]:<8} {seconds:6.1f} s  {m.name}", flush=True)
        if verdict.startswith("error"):
            print(verdict)
    print(f"{len(chosen) - missed} of {len(chosen)} caught")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
