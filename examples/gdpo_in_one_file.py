"""GDPO in one file: a language model trained on several rewards at once, on one device, read top to bottom.

    python examples/gdpo_in_one_file.py                                   # SmolLM2-135M-Instruct, the CPU demo's task
    python examples/gdpo_in_one_file.py --estimator grpo                  # the baseline, on the same prompts
    python examples/gdpo_in_one_file.py --model tiny-random --max-steps 2 # a tiny random model: seconds

minigdpo's algorithm with none of its systems: no FSDP, no vLLM, no LoRA, no checkpoints, no micro-batches.
One training step:
  1. B prompts from a task of rewards/ (arith: small word problems; rewards correct, integer, format);
  2. G completions for each, sampled with the model's own generate();
  3. R rewards for each completion: a (B, G, R) tensor;
  4. the advantage of each completion. GRPO sums its rewards and z-scores the sum within its group of G.
     GDPO z-scores each reward within the group (the paper's Eq. 4), sums them (Eq. 5) and z-scores that sum
     over the whole batch (Eq. 6), so that (1, 1) against (0, 0) is not the same signal as (1, 0) against (0, 0);
  5. each completion token's log-prob under the policy and under a frozen copy of the starting model (the
     reference), the textbook way: log_softmax(logits / temperature).gather(token);
  6. PPO's clipped surrogate plus a k3 KL penalty to the reference, averaged over every completion token, and
     one AdamW step.

This is the algorithm train.py runs, not a sketch of it: tests/test_one_file.py gives this file and train.py's
path (micro-batches, the shared-prefix and padding-free passes, the chunked head, FSDP2) the same prompts,
completions and rewards for three steps, each side with its own optimizer and defaults (this file's Args and
train.py's cpu-demo preset, there with this file's beta 0.04 where the demo's is 0), and checks that they compute
the same advantages, loss, KL and gradients, and take the same optimizer steps. Where they differ on purpose:
this file averages the loss over all of a batch's tokens, which train.py does with --loss-agg token_mean (its
default bnpo, the paper's, weighs each micro-batch alike, the same only with one micro-batch); a reward that does not apply counts as 0 here, where train.py's GDPO leaves it out
of its group's statistics (under GRPO both add it as 0); and there is no learning-rate schedule here. README.md
("Reading the code") says where each system train.py adds lives, and why.

Shape legend: B prompts, G completions per prompt, R rewards, N = B * G completions, P prompt tokens, T
completion tokens, V vocabulary.
"""

import argparse
import json
import operator
import os
import re
import sys
import time
from dataclasses import dataclass, fields

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from minigdpo.models import load_model, load_tokenizer, resolve_model  # noqa: E402  (hub names, tiny-random)
from minigdpo.scoring import RewardScorer  # noqa: E402
from rewards import PromptOrder, encode_prompt, load_task  # noqa: E402


@dataclass
class Args:
    model: str = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a hub name, a local directory, or tiny-random
    task: str = "arith"             # a task of rewards/: its prompts and its default rewards
    rewards: str = ""               # comma-separated reward names; empty: the task's
    condition: str = ""             # Eq. 8, e.g. length_ok:correct>=1: a reward counts only where another passes
    estimator: str = "gdpo"         # gdpo or grpo
    max_steps: int = 12
    batch_size: int = 32            # completions per step: B = batch_size / group_size prompts
    group_size: int = 8             # G
    max_prompt_len: int = 256
    max_new_tokens: int = 48
    temperature: float = 0.7
    lr: float = 2e-5
    beta: float = 0.04              # weight of the KL penalty
    clip_low: float = 0.2           # the ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2
    max_grad_norm: float = 1.0
    arith_difficulty: int = 1
    seed: int = 42
    output_dir: str = "runs/one-file"


# 4. Advantages ----------------------------------------------------------------------------------

EPS = 1e-4  # added to every std, as in the paper's released code


def group_zscore(x):
    """(x - mean) / (std + EPS) within each group: over dim 1 of (B, G) or (B, G, R), std with Bessel's n - 1."""
    return (x - x.mean(dim=1, keepdim=True)) / (x.std(dim=1, keepdim=True) + EPS)


def grpo(rewards):
    """GRPO: each completion's rewards summed, then z-scored within its group. (B, G, R) -> (B, G)"""
    return group_zscore(rewards.sum(dim=-1))


def gdpo(rewards):
    """GDPO (arXiv 2601.05242): Eq. 4, 5 and 6. (B, G, R) -> (B, G). With one reward it is GRPO, as in the
    paper's released code."""
    if rewards.shape[-1] == 1:
        return grpo(rewards)
    per_reward = group_zscore(rewards)                             # (B, G, R)  Eq. 4: each reward in its group
    summed = per_reward.sum(dim=-1)                                # (B, G)     Eq. 5: their sum
    return (summed - summed.mean()) / (summed.std() + EPS)         # (B, G)     Eq. 6: over the whole batch


OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt, "==": operator.eq}


def apply_condition(rewards, names, spec):
    """Eq. 8: `target:source>=threshold` keeps reward `target` only where reward `source` passes, else 0. A reward's
    name may hold a colon (mypkg.rewards:polite): the split at the colon that leaves two of the run's rewards."""
    if not spec:
        return rewards
    pair, op, threshold = re.fullmatch(r"(.+?)(>=|<=|==|>|<)([-\d.eE]+)", spec).groups()
    target, source = next((pair[:i], pair[i + 1:]) for i, ch in enumerate(pair)
                          if ch == ":" and pair[:i] in names and pair[i + 1:] in names)
    out = rewards.clone()                                          # (B, G, R)
    passed = OPS[op](rewards[..., names.index(source)], float(threshold))
    out[..., names.index(target)] = torch.where(passed, rewards[..., names.index(target)], 0.0)
    return out


# 5. Log-probs -----------------------------------------------------------------------------------

def token_logprobs(model, prompt_ids, prompt_mask, completion_ids, temperature):
    """log p(token | everything before it) of each completion token, (N, T): the full sequence through the model,
    log_softmax(logits / temperature), and the sampled token's entry. Prompts are left-padded, so positions
    count real tokens only; completions are right-padded (the padding is never attended to by a real token)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)                          # (N, P + T)
    attention = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # (N, P + T)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)                           # (N, P + T)
    T = completion_ids.shape[1]  # the logits of the last T + 1 positions only: the prompt's are never needed
    logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, logits_to_keep=T + 1).logits
    logits = logits[:, :-1].float() / temperature                                 # (N, T, V): each predicts the next
    return torch.log_softmax(logits, dim=-1).gather(-1, completion_ids[..., None]).squeeze(-1)  # (N, T)


# 6. The update ----------------------------------------------------------------------------------

def update(policy, reference, optimizer, batch, rewards, names, args):
    """One step on a sampled batch: advantages, the clipped surrogate with the KL penalty, one AdamW step.
    batch: prompt_ids, prompt_mask (N, P) and completion_ids, completion_mask (N, T), completions group by group;
    rewards: (B, G, R). Returns the advantages (B, G), the loss and the mean KL."""
    shaped = apply_condition(rewards, names, args.condition)                      # (B, G, R)
    advantages = {"gdpo": gdpo, "grpo": grpo}[args.estimator](shaped)             # (B, G)
    inputs = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], args.temperature)
    logp = token_logprobs(policy, *inputs)                                        # (N, T)
    with torch.no_grad():
        ref_logp = token_logprobs(reference, *inputs)                             # (N, T)
    old_logp = logp.detach()  # the policy that sampled this batch is this one: the ratio starts at 1
    mask = batch["completion_mask"]                                               # (N, T)
    adv = advantages.reshape(-1, 1).float()                                       # (N, 1)

    # With one pass over each batch (train.py's --num-iterations 1) the ratio is exactly 1, so the clip never binds
    # and the surrogate's gradient is the policy gradient, adv * grad(logp); its clip acts from a second pass on.
    ratio = torch.exp(logp - old_logp)                                            # (N, T)
    clipped = torch.clamp(ratio, 1 - args.clip_low, 1 + args.clip_high)          # (N, T)
    surrogate = -torch.min(ratio * adv, clipped * adv)                            # (N, T) PPO's clipped objective
    kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1                       # (N, T) k3: unbiased and >= 0
    loss = ((surrogate + args.beta * kl) * mask).sum() / mask.sum()               # the mean over completion tokens

    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
    optimizer.step()
    return advantages, loss.item(), ((kl * mask).sum() / mask.sum()).item()


# 1-3. Prompts, completions, rewards -------------------------------------------------------------

@torch.no_grad()
def sample(policy, tokenizer, prompts, args):
    """G completions of each prompt (lists of token ids), sampled from the policy at the training temperature,
    each ending at its first stop token (kept). Returns the padded batch and the completions' texts."""
    G = args.group_size
    left = tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    out = policy.generate(**left, do_sample=True, temperature=args.temperature, top_k=0, top_p=1.0,
                          max_new_tokens=args.max_new_tokens, num_return_sequences=G,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    completion_ids = out[:, left.input_ids.shape[1]:]                            # (N, T)
    stop = (completion_ids == tokenizer.eos_token_id).int()
    before_stop = (stop.cumsum(-1) - stop) == 0                                   # (N, T) up to the first stop
    completion_mask = before_stop.float()                                         # (N, T)
    completion_ids = torch.where(before_stop, completion_ids, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    batch = {"prompt_ids": left.input_ids.repeat_interleave(G, 0), "prompt_mask": left.attention_mask.repeat_interleave(G, 0),
             "completion_ids": completion_ids, "completion_mask": completion_mask}
    return batch, texts


def build(path, args):
    """The policy, its frozen copy (the reference: the KL's anchor) and AdamW at torch's defaults (betas 0.9 and
    0.999, eps 1e-8), without weight decay, as train.py's cpu-demo preset runs it."""
    policy = load_model(path, torch.float32).train()
    reference = load_model(path, torch.float32).eval().requires_grad_(False)
    return policy, reference, torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in fields(Args):
        parser.add_argument("--" + f.name.replace("_", "-"), type=f.type, default=f.default)
    args = Args(**vars(parser.parse_args(argv)))
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    policy, reference, optimizer = build(path, args)
    task = load_task(args.task, "", "train", False, {"arith_difficulty": args.arith_difficulty})
    names = args.rewards.split(",") if args.rewards else task.rewards
    scorer = RewardScorer(names)
    order, B = PromptOrder(len(task.examples), args.seed), args.batch_size // args.group_size
    os.makedirs(args.output_dir, exist_ok=True)
    log = open(os.path.join(args.output_dir, "metrics.jsonl"), "w")
    print(f"{args.estimator} on {args.task}, rewards {names}, {B} prompts x {args.group_size} completions a step")

    for step in range(1, args.max_steps + 1):
        t0 = time.perf_counter()
        examples = [task.examples[i] for i in order.take((step - 1) * B, B)]                    # 1. prompts
        prompts = [encode_prompt(tokenizer, ex["messages"], args.max_prompt_len) for ex in examples]
        policy.eval()
        batch, texts = sample(policy, tokenizer, prompts, args)                                  # 2. completions
        policy.train()
        lengths = batch["completion_mask"].sum(-1).tolist()
        per_completion = [ex for ex in examples for _ in range(args.group_size)]
        scores, _ = scorer(texts, per_completion, lengths)                                       # 3. rewards (N, R)
        # A reward that does not apply (None: NaN) counts as 0 here; train.py's GDPO leaves it out of its group.
        rewards = scores.nan_to_num(0.0).view(B, args.group_size, len(names))                    # (B, G, R)
        advantages, loss, kl = update(policy, reference, optimizer, batch, rewards, names, args)  # 4-6.
        row = {"step": step, **{f"reward/{n}/mean": rewards[..., k].mean().item() for k, n in enumerate(names)},
               "loss": loss, "kl": kl, "adv/std": advantages.std().item(), "completion/len_mean": sum(lengths) / len(lengths),
               "time/step": time.perf_counter() - t0}
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(f"step {step}: " + ", ".join(f"{k.split('/')[1] if k.startswith('reward/') else k} {v:.3g}"
                                           for k, v in row.items() if k != "step"))
    log.close()


if __name__ == "__main__":
    main()
