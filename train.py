"""Train a language model with GDPO (or GRPO) on several rewards: the whole RL loop, top to bottom.

Each step:
  1. take B prompts (this rank's share of them);
  2. sample G completions for each;
  3. score the R rewards into a (B, G, R) tensor;
  4. all-gather the rewards, apply conditions (Eq. 8) and run the advantage estimator
     over the global batch (GDPO: Eq. 4-6);
  5. compute the reference log-probs (and the old ones when num_iterations > 1);
  6. run num_iterations passes of micro-batched clipped-surrogate updates;
  7. push the new weights to the sampler;
  8. log, and checkpoint when due.

With no other flag, `--estimator gdpo` runs the paper's released GSM8K recipe:
Qwen2.5-1.5B-Instruct, rewards correct/integer/format, G=16, 512 completions per step,
lr 5e-6 cosine with 10% warmup, beta 0.04, clip 0.2, 512/1024 prompt/completion tokens.

Departures from that recipe (all deliberate, all documented):
- NaN rewards are left out of group statistics instead of being counted as 0;
- GSM8K answers with thousands separators compare equal to the bare digits;
- the default rollout backend on GPU is vLLM colocated in each rank (TRL's colocate mode).

LoRA (--lora-rank R, needs peft): only rank-R adapters on the attention and MLP projections train,
on a frozen base; step 5's reference is the same model with its adapters switched off, and step 7
pushes the merged weights, base + (alpha / R) B A (minigdpo/lora.py).

Launch:
  python train.py --preset cpu-demo                          # offline CPU demo, ~11 min on 2 cores
  python train.py --preset smoke                             # tiny random model, seconds
  python train.py --preset a100 --estimator gdpo             # one 80 GB A100
  python train.py --preset a100-lora --estimator gdpo        # Qwen2.5-7B-Instruct with LoRA on one 80 GB A100
  python train.py --preset cpu-demo --lora-rank 16           # LoRA adapters on the CPU demo
  torchrun --nproc_per_node 8 train.py --estimator gdpo      # the paper's recipe on 8 GPUs
  torchrun --nnodes 2 --nproc_per_node 8 --rdzv_endpoint HOST:29500 train.py --estimator gdpo --output-dir /shared/run
                                                             # 2 nodes: HSDP, one shared output dir
  torchrun --nproc_per_node 2 train.py --preset smoke        # FSDP2 over 2 gloo ranks on CPU

Shape legend: B prompts, G samples per prompt, R rewards, S = this rank's sequences, T tokens.
"""

import sys
import time
import traceback

import torch

from minigdpo import checkpoint, config, data, dist, lora, metrics, policy
from minigdpo.advantages import ESTIMATORS, Condition, apply_conditions
from minigdpo.collapse import distinct_per_group
from minigdpo.loss import policy_loss
from rewards import PromptOrder, RewardScorer, encode_prompt, load_task
from minigdpo.sampler import SamplingParams, SamplerUnavailable, left_pad, make_sampler, resolve_kind


def compute_dtype(cfg, device):
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.dtype]


def micro_batches(prompts, completions, advantages, size, pad_id, device, group):
    """Split this rank's sequences into micro-batches of whole or partial groups.

    Sequences come prompt-major (each prompt's `group` completions in a row); prompts are taken
    in order of length to cut padding. Each micro-batch holds its distinct prompts once:
    prompt_ids, prompt_mask (b, P) left-padded and repeats (b,), then completion_ids, mask,
    sampler_logp (n, T) right-padded and adv (n,), with `index`, the sequences' local positions.
    """
    by_length = sorted(range(len(prompts) // group), key=lambda p: len(prompts[p * group]))
    order = [p * group + j for p in by_length for j in range(group)]
    out = []
    for s in range(0, len(order), size):
        idx = order[s:s + size]
        owner_of = [i // group for i in idx]
        owners = list(dict.fromkeys(owner_of))                             # distinct prompts, in order
        repeats = torch.tensor([owner_of.count(p) for p in owners])        # (b,)
        prompt_ids, prompt_mask = left_pad([prompts[p * group] for p in owners], pad_id, device)  # (b, P)
        T = max(1, max(len(completions[i].token_ids) for i in idx))
        completion_ids = torch.full((len(idx), T), pad_id, dtype=torch.long)    # (n, T)
        mask = torch.zeros((len(idx), T))                                        # (n, T)
        sampler_logp = torch.zeros((len(idx), T))                                # (n, T)
        for row, i in enumerate(idx):
            n = len(completions[i].token_ids)
            if n:
                completion_ids[row, :n], mask[row, :n] = torch.tensor(completions[i].token_ids), 1
                sampler_logp[row, :n] = torch.tensor(completions[i].logprobs)
        out.append({"index": idx, "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
                    "repeats": repeats.to(device), "completion_ids": completion_ids.to(device), "mask": mask.to(device),
                    "adv": advantages[idx].to(device), "sampler_logp": sampler_logp.to(device)})
    return out


def model_tokens(batches, shared):
    """Tokens one forward pass over `batches` runs through the model: each distinct prompt once
    when prompts are shared across their completions, once per completion otherwise."""
    total = 0.0
    for mb in batches:
        prompt = mb["prompt_mask"].sum(-1)                                 # (b,)
        total += (prompt.sum() if shared else (prompt * mb["repeats"]).sum()).item() + mb["mask"].sum().item()
    return total


def logprobs(model, mb, cfg, entropy=False):
    """The model's per-token log-probs (n, T) of a micro-batch's completions (and entropies)."""
    return model(mb["prompt_ids"], mb["prompt_mask"], mb["repeats"], mb["completion_ids"], mb["mask"], cfg.temperature,
                 cfg.logprob_chunk, entropy, share_prefix=not cfg.grad_checkpointing)


@torch.no_grad()
def fill_logprobs(model, batches, key, cfg, reshard=False):
    """Store a no-grad log-prob pass (reference or old policy) in each micro-batch under `key`;
    reshard=True then frees the parameters FSDP2 keeps gathered for a backward (none for the reference)."""
    for mb in batches:
        mb[key] = logprobs(model, mb, cfg)
    if reshard:
        dist.reshard(model)


def update(model, opt, sched, batches, cfg, num_tokens, num_seqs):
    """num_iterations optimizer steps over the micro-batches; returns summed loss statistics.

    num_tokens / num_seqs are the global counts divided by the world size: FSDP averages
    gradients over ranks, so this makes every aggregation exact over the global batch.
    """
    totals, gap = {}, torch.zeros(2, device=batches[0]["mask"].device)
    for it in range(cfg.num_iterations):
        opt.zero_grad(set_to_none=True)
        for i, mb in enumerate(batches):
            last = i == len(batches) - 1  # gradients cross ranks once per optimizer step (cfg.reduce_grads)
            dist.reduce_gradients(model, reduce_scatter=last or cfg.reduce_grads == "micro_batch", all_reduce=last)
            logp, entropy = logprobs(model, mb, cfg, entropy=True)
            old = mb.get("old_logp", logp.detach())  # num_iterations == 1: the policy that sampled is this one
            is_weight = None
            if cfg.tis_cap:  # truncated importance sampling for the sampler/trainer mismatch (Yao et al., 2025)
                is_weight = torch.exp(old - mb["sampler_logp"]).clamp(max=cfg.tis_cap) * mb["mask"]
            loss, stats = policy_loss(logp, old, mb.get("ref_logp"), mb["adv"], mb["mask"], clip_low=cfg.clip_low,
                                      clip_high=cfg.clip_high, beta=cfg.beta, agg=cfg.loss_agg, num_tokens=num_tokens,
                                      num_seqs=num_seqs, max_len=cfg.max_new_tokens, num_micro_batches=len(batches),
                                      is_weight=is_weight)
            loss.backward()
            if it == 0:
                stats["entropy"] = (entropy * mb["mask"]).sum()
                stats["loss"] = loss.detach()
                gap += torch.stack([((old - mb["sampler_logp"]).abs() * mb["mask"]).sum(), mb["mask"].sum()])
                for k, v in stats.items():
                    totals[k] = v if k not in totals else (
                        torch.minimum(totals[k], v) if k == "ratio_min" else
                        torch.maximum(totals[k], v) if k == "ratio_max" else totals[k] + v)
        grad_norm = policy.clip_grad(model, cfg.max_grad_norm)
        if torch.isfinite(grad_norm):  # a NaN/inf gradient skips the step instead of poisoning the weights
            opt.step()
            sched.step()
        else:
            totals["skipped_steps"] = totals.get("skipped_steps", 0) + 1
        totals["grad_norm"] = grad_norm
    opt.zero_grad(set_to_none=True)  # free the gradients before the sampler wakes up
    totals["logp_gap"] = gap
    return totals


def loss_metrics(totals):
    """Reduce the update statistics over ranks into per-token means."""
    sums = torch.stack([totals[k].float() for k in ("tokens", "loss", "pg_loss", "kl", "clip_low", "clip_high",
                                                     "ratio", "entropy")] + list(totals["logp_gap"].float()))
    sums = dist.all_reduce(sums)
    tokens = max(sums[0].item(), 1.0)
    lo = dist.all_reduce(totals["ratio_min"].float().clone(), op="min").item()
    hi = dist.all_reduce(totals["ratio_max"].float().clone(), op="max").item()
    return {"loss": sums[1].item() / dist.world_size(),  # each rank's loss carries the 1/world of its normaliser
            "loss/pg": sums[2].item() / tokens, "kl": sums[3].item() / tokens,
            "loss/clip_low_frac": sums[4].item() / tokens, "loss/clip_high_frac": sums[5].item() / tokens,
            "loss/ratio_mean": sums[6].item() / tokens, "loss/ratio_min": lo, "loss/ratio_max": hi,
            "entropy": sums[7].item() / tokens, "grad_norm": totals["grad_norm"].item(),
            "sampler/logp_gap": sums[8].item() / max(sums[9].item(), 1.0),
            "loss/skipped_steps": totals.get("skipped_steps", 0)}


def rewards_setup(cfg, task):
    """Reward names, conditions, weights and scorer; any bad name or count is a ConfigError."""
    names = cfg.rewards or task.rewards
    try:
        if len(set(names)) != len(names):
            raise ValueError(f"--rewards lists a reward twice: {names}")
        conditions = [Condition.parse(c) for c in cfg.condition]
        apply_conditions(torch.zeros(1, 1, len(names)), names, conditions)  # checks the names
        if cfg.reward_weights and len(cfg.reward_weights) != len(names):
            raise ValueError(f"--reward-weights has {len(cfg.reward_weights)} values for {len(names)} rewards {names}")
        scorer = RewardScorer(names, timeout=cfg.reward_timeout)
    except ValueError as e:
        raise config.ConfigError(str(e)) from None
    weights = torch.tensor(cfg.reward_weights or [1.0] * len(names), dtype=torch.float64)
    return names, conditions, weights, scorer


def release_frames(error):
    """Let go of the locals of the frames an exception's traceback keeps (run_training's holds the
    sharded model), along its chain of causes and contexts; the traceback still prints."""
    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is not None and id(e) not in seen:
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)
            todo += [e.__cause__, e.__context__]


def main(argv=None):
    """Train; the process group is destroyed on every exit, errors included, once the training
    state that holds it is gone (dist.cleanup says why that order matters)."""
    try:
        run_training(argv)
    except BaseException as e:
        release_frames(e)
        raise
    finally:
        dist.cleanup()


def run_training(argv=None):
    cfg = config.parse_args(argv, __doc__)
    config.validate(cfg)  # before anything heavy: a bad value costs no model load
    extra = {"length_limit": cfg.length_limit, "length_unit": cfg.length_unit, "answer_format": cfg.answer_format}
    task = load_task(cfg.task, cfg.data, "train", cfg.skip_bad_rows, {"arith_difficulty": cfg.arith_difficulty}, extra)
    reward_names, conditions, weights, scorer = rewards_setup(cfg, task)
    config.check_sampler(cfg, resolve_kind(cfg.sampler))  # a missing vLLM or GPU, or settings vLLM cannot honour
    # Built-in models are built before the process group exists: with one, transformers saves on rank 0 only.
    path = policy.resolve_model(cfg.model)
    policy.check_context(path, cfg.max_prompt_len + cfg.max_new_tokens)  # still before any weights load
    adapters = lora.settings(cfg)  # None: full fine-tuning
    if adapters:
        policy.check_lora_targets(path, adapters.targets)  # on the meta device, still before any weights load
    try:
        device = dist.init(cfg.sharding)
    except ValueError as e:  # nodes with different numbers of ranks cannot form an HSDP mesh
        raise config.ConfigError(f"--sharding {cfg.sharding}: {e}") from None
    derived = config.resolve(cfg, dist.world_size(), len(task.examples), dist.mesh().shape)
    checkpoint.check_shared(cfg.output_dir)  # multi-node: one filesystem for every rank, checked before any load
    run = config.describe(cfg, derived) | {"rewards": reward_names}
    dist.print0(f"minigdpo: {cfg.estimator} on {cfg.task} ({len(task.examples)} prompts"
                + (f", {task.skipped} malformed rows skipped" if task.skipped else "") + f"), rewards {reward_names}")
    dist.print0(" ".join(f"{k}={v}" for k, v in vars(derived).items()))
    torch.manual_seed(cfg.seed)

    # Models: the trained policy, its frozen reference, and the sampler's inference copy.
    # With LoRA the reference is the policy with its adapters switched off: no second model.
    tokenizer = policy.load_tokenizer(path)
    dtype = compute_dtype(cfg, device)
    model = policy.build(path, device, dtype, cfg.grad_checkpointing, lora=adapters)
    ref = policy.build(path, device, dtype, frozen=True, offload=cfg.ref_offload) if cfg.beta > 0 and not adapters else None
    opt = policy.optimizer(model, cfg.lr, cfg.weight_decay)  # the parameters that require grad: with LoRA, the adapters
    n_trainable, n_params = lora.trainable_count(model)  # global counts, also under FSDP
    dist.print0(f"parameters: {n_params:,}, trainable: {n_trainable:,}")
    sched = policy.scheduler(opt, derived.total_steps * cfg.num_iterations, cfg.warmup_ratio, cfg.lr_schedule)
    stop_ids = policy.stop_token_ids(model.lm.config, model.lm.generation_config, tokenizer)
    sampler = make_sampler(cfg.sampler, path, device, tokenizer, stop_ids, dtype, seed=cfg.seed + dist.rank(),
                           gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                           max_model_len=cfg.max_prompt_len + cfg.max_new_tokens)
    save_dtype = policy.source_dtype(path)  # exports keep the checkpoint's dtype, not the fp32 master copy's

    start, cursor = 0, 0
    if cfg.resume:
        last, removed = checkpoint.resume_point(cfg.output_dir)  # decided on rank 0, the same on every rank
        for p in removed:
            dist.print0(f"removed incomplete checkpoint {p}")
        if last is None:
            dist.print0(f"--resume: no complete checkpoint in {cfg.output_dir}, starting from step 0")
        else:
            state = checkpoint.load(last, model, opt, sched)
            start, cursor = state["step"], state["cursor"]
            sampler.load_weights(policy.hf_state(model, dtype))
            dist.print0(f"resumed from {last} at step {start}")

    order = PromptOrder(len(task.examples), cfg.seed)
    log = metrics.Logger(cfg.output_dir, derived.total_steps, start, run, cfg.wandb)
    params = SamplingParams(cfg.temperature, cfg.top_p, cfg.max_new_tokens, ignore_eos=cfg.ignore_eos)
    B, G, R, rank = derived.prompts_per_step, cfg.group_size, len(reward_names), dist.rank()

    for step in range(start + 1, derived.total_steps + 1):
        t_step = time.perf_counter()
        # 1. This rank's prompts: a contiguous slice of the global batch, so groups never straddle ranks.
        batch_idx = order.take(cursor, B)[rank * derived.prompts_per_rank:(rank + 1) * derived.prompts_per_rank]
        cursor += B
        examples = [task.examples[i] for i in batch_idx]
        prompts = [encode_prompt(tokenizer, ex["messages"], cfg.max_prompt_len) for ex in examples]

        # 2. Sample G completions per prompt.
        t0 = time.perf_counter()
        sampler.wake()
        params.seed = cfg.seed * 1_000_003 + step * 1_009 + rank  # reproducible, and so resumable exactly
        groups = sampler.generate(prompts, G, params)
        sampler.sleep()
        completions = [c for group in groups for c in group]                  # S = prompts_per_rank * G
        seq_prompts = [p for p in prompts for _ in range(G)]
        t_gen = time.perf_counter() - t0

        # 3. Score every reward: (S, R) here, NaN where a reward does not apply or failed.
        t0 = time.perf_counter()
        local, counts = scorer([c.text for c in completions], [ex for ex in examples for _ in range(G)],
                               [len(c.token_ids) for c in completions])
        t_reward = time.perf_counter() - t0

        # 4. Advantages over the global batch (GDPO's batch step must see every rank's groups).
        rewards = dist.all_gather(local.to(device)).view(B, G, R).double()    # (B, G, R)
        lengths = dist.all_gather(torch.tensor([len(c.token_ids) for c in completions], device=device)).float()  # (B*G,)
        shaped = apply_conditions(rewards, reward_names, conditions)         # (B, G, R) Eq. 8
        adv_all = ESTIMATORS[cfg.estimator](shaped, weights.to(device), lengths=lengths.view(B, G))  # (B, G)
        adv = adv_all[rank * derived.prompts_per_rank:(rank + 1) * derived.prompts_per_rank].reshape(-1).float().cpu()

        # 5. Reference (and old) log-probs, one no-grad pass in micro-batches.
        t0 = time.perf_counter()
        batches = micro_batches(seq_prompts, completions, adv, cfg.micro_batch_size, tokenizer.pad_token_id, device, G)
        if ref is not None:
            fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)
        elif adapters and cfg.beta > 0:
            with lora.adapters_off(model):
                fill_logprobs(model, batches, "ref_logp", cfg)
        if cfg.num_iterations > 1:
            fill_logprobs(model, batches, "old_logp", cfg)
        t_logprob = time.perf_counter() - t0

        # 6. Policy update.
        t0 = time.perf_counter()
        tokens = max(1.0, dist.all_reduce(sum(mb["mask"].sum() for mb in batches).reshape(1)).item())
        totals = update(model, opt, sched, batches, cfg, tokens / dist.world_size(), derived.seqs_per_rank)
        t_update = time.perf_counter() - t0
        update_tokens = model_tokens(batches, shared=not cfg.grad_checkpointing)
        update_tokens = dist.all_reduce(torch.tensor([update_tokens], dtype=torch.float64, device=device)).item()

        # 7. The sampler gets the new weights, streamed one tensor at a time.
        t0 = time.perf_counter()
        sampler.load_weights(policy.hf_state(model, dtype))
        t_sync = time.perf_counter() - t0

        # 8. Log and checkpoint.
        truncated = dist.all_gather(torch.tensor([c.finish_reason == "length" for c in completions], device=device))
        gen_tokens = lengths.sum().item()
        m = metrics.reward_metrics(rewards.cpu(), reward_names, metrics.sum_counts(dist.all_gather_object(counts)))
        m |= loss_metrics(totals)
        m |= {"adv/mean": adv_all.mean().item(), "adv/std": adv_all.std().item(),
              "adv/distinct_per_group": distinct_per_group(adv_all).float().mean().item(),
              "adv/zero_groups": (adv_all.abs().amax(dim=1) < 1e-6).float().mean().item(),
              "completion/len_mean": lengths.mean().item(), "completion/len_max": lengths.max().item(),
              "completion/truncated_frac": truncated.float().mean().item(), "lr": sched.get_last_lr()[0],
              "time/generate": t_gen, "time/reward": t_reward, "time/logprob": t_logprob, "time/update": t_update,
              "time/sync": t_sync, "time/step": time.perf_counter() - t_step,
              "throughput/gen_tokens_per_s": gen_tokens / max(t_gen, 1e-9),
              "throughput/update_tokens_per_s": update_tokens / max(t_update, 1e-9),
              "throughput/update_tflops_per_device": 6 * n_params * update_tokens / max(t_update, 1e-9) / 1e12 / dist.world_size()}
        if m["sampler/logp_gap"] > cfg.logp_gap_warn:
            log.write(f"warning: step {step}: sampler/trainer log-prob gap {m['sampler/logp_gap']:.3f} > "
                      f"{cfg.logp_gap_warn} (stale or broken weight sync?)", error=True)
        log.log(step, m)
        if cfg.samples_every and step % cfg.samples_every == 0:
            log.samples(step, [{"prompt": tokenizer.decode(seq_prompts[i], skip_special_tokens=True)[-300:],
                                "completion": completions[i].text, "advantage": adv[i].item(),
                                "rewards": dict(zip(reward_names, local[i].tolist()))} for i in range(min(4, len(completions)))])
        if (cfg.save_every and step % cfg.save_every == 0) or step == derived.total_steps:
            try:
                where = checkpoint.save(cfg.output_dir, step, model, opt, sched, tokenizer,
                                        {"cursor": cursor, **run}, save_dtype, cfg.keep_checkpoints,
                                        export_hf=not adapters or cfg.merge_on_save)
                log.write(f"step {step}: saved {where}")
            except checkpoint.CheckpointError as e:
                log.write(f"error: {e}", error=True)
                if cfg.on_save_error == "stop":
                    log.close()
                    raise SystemExit(f"stopped at step {step}: the last complete checkpoint is "
                                     f"{checkpoint.latest(cfg.output_dir) or 'none'}") from None

    log.close()
    dist.print0(metrics.start_end_table(log.first, log.recent, reward_names))
    if cfg.final_eval:  # every rank, with the trainer's own sampler: no second vLLM engine in this process
        import eval as evaluation

        evaluation.after_training(cfg, sampler, tokenizer)
    dist.barrier()  # every rank got here: main's cleanup may close the connections


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        main()
    except (config.ConfigError, data.DataError, SamplerUnavailable) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
