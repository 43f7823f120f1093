"""Train a language model with GDPO (or GRPO) on several rewards: the whole RL loop, top to bottom.

Each step:
  1. take B prompts (this rank's share of them);
  2. sample G completions for each;
  3. score the R rewards into a (B, G, R) tensor, all-gathered over the ranks;
  4. apply conditions (Eq. 8) and run the advantage estimator over the global batch (GDPO: Eq. 4-6);
  5. compute the reference log-probs (and the old ones when num_iterations > 1);
  6. run num_iterations passes of micro-batched clipped-surrogate updates;
  7. push the new weights to the sampler;
  8. log, and checkpoint when due.

With no other flag, `--estimator gdpo` runs the paper's released GSM8K recipe: Qwen2.5-1.5B-Instruct,
rewards correct/integer/format, G=16, 512 completions per step, lr 5e-6 cosine with 10% warmup, beta
0.04, clip 0.2, 512/1024 prompt/completion tokens, its trl-0.18 loss normaliser (bnpo). Departures,
all deliberate: under GDPO a NaN reward is left out of its group's statistics instead of counting as 0
(summed, as under GRPO, it adds 0, as in TRL: minigdpo/advantages.py); GSM8K answers
with thousands separators equal the bare digits; on GPUs vLLM samples inside each rank (TRL's colocate
mode). With LoRA (--lora-rank R) only adapters train; step 5's reference is the model with its adapters
off, and step 7 pushes the adapters alone: the sampler applies them as the trainer does (minigdpo/lora.py).

The update's throughput in metrics.jsonl counts real tokens only, never padding, and its TFLOP/s add attention's
12 x layers x hidden per causal (query, key) pair to 6 x parameters per token (docs/outputs.md).

Launch:
  python train.py --preset cpu-demo                          # offline CPU demo, about 3 min on 2 cores
  python train.py --preset a100 --estimator gdpo             # one 80 GB A100 (a100-lora: Qwen2.5-7B with LoRA)
  torchrun --nproc_per_node 8 train.py --estimator gdpo      # the paper's recipe on 8 GPUs
  torchrun --nnodes 2 --nproc_per_node 8 --rdzv_endpoint HOST:29500 train.py --estimator gdpo --output-dir /shared/run
  torchrun --nproc_per_node 2 train.py --preset smoke        # FSDP2 over 2 gloo ranks on CPU, seconds

Shape legend: B prompts per step, G samples per prompt, R rewards, S groups the step trains on (B; with
--dynamic-sampling, those found).
"""

import sys
import time

import torch

from minigdpo import checkpoint, cli, config, dist, dynamic_sampling, logprobs, lora, microbatch, models, pipeline, \
    policy, rollout, scoring, split, tools
from minigdpo.advantages import Condition, advantage_stats, apply_conditions
from minigdpo.estimators import REGISTRY
from minigdpo.data import DataError
from minigdpo.report import Logger, reward_metrics, start_end_table
from minigdpo.rollout import timed
from minigdpo.update import fill_logprobs, optimizer, scheduler, step_metrics, throughput, update
from minigdpo.vllm_sampler import SamplerUnavailable, check_sampler, make_sampler, resolve_kind
from minigdpo.scoring import RewardScorer
from rewards import PromptOrder, RewardError, load_task, metric_names
from rewards.reward_model import RewardModelError


def run_training(argv=None):
    cfg = cli.parse_args(argv, __doc__)  # every value checked: a bad one costs no model load
    reward_options = {"length_limit": cfg.length_limit, "length_unit": cfg.length_unit,
                      "answer_format": cfg.answer_format}
    task = load_task(cfg.task, cfg.data, "train", cfg.skip_bad_rows, {"arith_difficulty": cfg.arith_difficulty},
                     reward_options)
    toolbox = tools.Toolbox(cfg.tools, cfg.environment) if cfg.tools or cfg.environment else None  # an agent's
    names, conditions, weights, scorer = rewards_setup(cfg, task, toolbox)
    check_sampler(cfg, resolve_kind(cfg.sampler))  # a missing vLLM or GPU, or settings vLLM cannot honour
    path = models.resolve_model(cfg.model)  # built-in models are built before the process group exists
    models.check_context(path, cfg.max_prompt_len + cfg.max_new_tokens)  # still before any weights load
    lora_settings = lora.settings(cfg)  # None: full fine-tuning
    if lora_settings:
        policy.check_lora_targets(path, lora_settings.targets)
    try:
        device = dist.init(cfg.sharding, cfg.sampler_ranks)  # with --sampler-ranks, this rank trains or samples
    except ValueError as e:  # nodes with different numbers of ranks cannot form an HSDP mesh; no rank left to train
        raise config.ConfigError(str(e)) from None
    role, others = dist.role(), len(dist.other_ranks()) if cfg.sampler_ranks else 0  # minigdpo/split.py
    sizes = config.resolve(cfg, dist.world_size(), len(task.examples), getattr(dist.mesh(), "shape", ()), others)
    sampling_group = dist.sampling_group() if cfg.async_steps and not cfg.sampler_ranks else None  # every rank, here
    if role != "sampler":  # multi-node: one filesystem for every rank that writes, checked before any load
        checkpoint.check_shared(cfg.output_dir)
    run = config.describe(cfg, sizes) | {"rewards": names}
    dist.print0(f"minigdpo: {cfg.estimator} on {cfg.task} ({len(task.examples)} prompts"
                + (f", {task.skipped} malformed rows skipped" if task.skipped else "") + f"), rewards {names}")
    dist.print0(" ".join(f"{k}={v}" for k, v in vars(sizes).items()))
    torch.manual_seed(cfg.seed)

    # The trained policy, its frozen reference (with LoRA: the policy, adapters off), the sampler's copy.
    context = cfg.max_prompt_len + cfg.max_new_tokens  # the longest sequence a pass may meet
    tokenizer = models.load_tokenizer(path)
    agent = toolbox and tools.Agent(toolbox, tokenizer, cfg.max_tool_calls, cfg.model, context, cfg.tool_timeout)
    dtype, why = models.compute_dtype(cfg.dtype, device)
    dist.print0(f"compute dtype {str(dtype).removeprefix('torch.')}: {why}")
    # Not sharded beside an asynchronous trainer (its gathers and the trainer's would meet from two threads), nor on
    # sampling ranks, which have no mesh; the ranks that only train score nothing.
    auto_resident = (cfg.async_steps or cfg.sampler_ranks) and cfg.reward_model_placement == "auto"
    if role != "trainer":
        scorer.place_models(device, dtype, cfg.reward_model_batch_size,
                            "resident" if auto_resident else cfg.reward_model_placement, policy.build_classifier)
    model = ref = opt = sched = None  # a sampling rank (--sampler-ranks) has none of them
    if role != "sampler":
        compiled = cfg.compile == "true"  # auto: eager everywhere for now (Config.compile says why)
        recompute = cfg.grad_checkpointing == "true" or cfg.grad_checkpointing == "auto" and device.type == "cpu"
        dist.print0(f"gradient checkpointing {'on' if recompute else 'off'} ({cfg.grad_checkpointing})")
        model = policy.build(path, device, dtype, recompute, lora_settings=lora_settings,
                             compile=compiled, context=context)
        if cfg.beta > 0 and not lora_settings:  # with LoRA the reference is the policy with its adapters off
            ref = policy.build(path, device, dtype, frozen=True, offload=cfg.ref_offload, compile=compiled,
                               context=context)
        lm_config = model.lm.config
        opt = optimizer(model, cfg.lr, cfg.weight_decay)  # the parameters that require grad: with LoRA, the adapters
        n_trainable, n_params = lora.trainable_count(model)  # global counts, also under FSDP
        dist.print0(f"parameters: {n_params:,}, trainable: {n_trainable:,}")
        # Model FLOPs per token of an update pass: forward 2N, input gradients 2N, weight gradients 2 per trainable
        # parameter (6N in full fine-tuning; LoRA's frozen weights get none). Recomputation is not counted (MFU).
        flops_per_token = 4 * n_params + 2 * n_trainable
        attention_flops = 12 * lm_config.num_hidden_layers * lm_config.hidden_size  # per causal (query, key) pair
        sched = scheduler(opt, sizes.total_steps * cfg.num_iterations, cfg.warmup_ratio, cfg.lr_schedule)
        if model.refusal:
            dist.print0(model.fallback_line(cfg.logprob_chunk, cfg.max_new_tokens))
    lm = model.lm if model is not None else models.empty_model(path, dtype)  # a sampling rank's: on the meta device
    stop_ids = models.stop_token_ids(lm.config, lm.generation_config, tokenizer)
    if role == "trainer":  # the sampling ranks hold the sampler (minigdpo/split.py)
        sampler = split.Remote(adapters_only=bool(lora_settings))
    else:
        sampler = make_sampler(cfg.sampler, path, device, tokenizer, stop_ids, dtype, seed=cfg.seed + dist.rank(),
                               gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                               kv_cache_gib=cfg.vllm_kv_cache_gib, max_model_len=context, lora_settings=lora_settings,
                               own_process=role == "sampler")  # vLLM's groups would span the trainers (vllm_sampler.py)
    gap_warn = cfg.logp_gap_warn or (1e-3 if dtype == torch.float32 else 0.05)  # config.py's logp_gap_warn
    save_dtype = models.source_dtype(path)  # exports keep the checkpoint's dtype, not the fp32 master copy's

    start, cursor, pending = 0, 0, []
    if cfg.resume and role != "sampler":  # the sampling ranks learn where the run starts from the trainers
        last, removed = checkpoint.resume_point(cfg.output_dir)  # decided on rank 0, the same on every rank
        for p in removed:
            dist.print0(f"removed incomplete checkpoint {p}")
        if last is None:
            dist.print0(f"--resume: no complete checkpoint in {cfg.output_dir}, starting from step 0")
        else:
            state = checkpoint.load(last, model, opt, sched)
            start, cursor, pending = state["step"], state["cursor"], checkpoint.load_pending(last)
            sampler.load_weights(model.whole_weights(dtype, adapters_only=sampler.adapters_only))
            dist.print0(f"resumed from {last} at step {start}")

    order, self_check, check_due = PromptOrder(len(task.examples), cfg.seed), {}, model is not None and model.fast
    options = REGISTRY[cfg.estimator].options(cfg)  # the estimator's own flags (gd2po's mode and tau, SAW's shift)
    log = Logger(cfg.output_dir, sizes.total_steps, start, run, cfg.wandb)

    def sample(step, version):
        """Steps 1-3 of `step`: its prompts, G completions each, their rewards (minigdpo/rollout.py), each rank its
        share; with --async-steps K while the trainer trains up to K steps behind (pipeline.py). `version`: the
        updates the sampler's weights have had. Returns (score, cursor): score() is step 3, run on the main thread."""
        nonlocal cursor
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the calling thread's current device (the pipeline may generate on its own)
        seconds = {}
        state = rollout.trainer_state(version + 1, cursor, cfg, sizes, len(task.examples))
        if cfg.dynamic_sampling:  # rounds of fresh prompts until B groups can be learned from
            batch, cursor = dynamic_sampling.sample(step, cursor, order, task, tokenizer, sampler, scorer, cfg, sizes,
                                                    names, conditions, weights, seconds, agent, state)
            return (lambda: batch), cursor
        examples, seed = rollout.step_prompts(step, cursor, order, task, cfg, sizes)
        score = rollout.rollout(examples, seed, tokenizer, sampler, scorer, cfg, seconds,
                                sleep=not (cfg.async_steps or cfg.sampler_ranks), agent=agent, state=state)
        cursor += sizes.prompts_per_step
        return score, cursor

    overlap = agent is None and not cfg.dynamic_sampling  # generation calls no tool or reward: beside the scoring
    if cfg.sampler_ranks:  # the trainers tell the sampling ranks where the run starts and send them its weights
        pipe, start, cursor = split.pipeline(
            cfg.async_steps, start, cursor, pending, sizes.total_steps, sample, sampler,
            lambda: model.whole_weights(dtype, main_only=True, adapters_only=sampler.adapters_only), overlap)
    else:
        pipe = pipeline.Pipeline(cfg.async_steps, start, sizes.total_steps, sample, sampler.load_weights, pending,
                                 overlap)

    def train():
        """Steps 4-8 of every step, in order (with --async-steps, in a thread of its own: pipeline.py)."""
        nonlocal self_check, check_due
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is the thread's own
        t_end = time.perf_counter()
        for step in range(start + 1, sizes.total_steps + 1):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # 1-3. The step's rollouts and rewards, sampled by the main thread (above) by weights at most K updates old.
            batch, after, staleness, waited, blocked = pipe.batch(step)
            seconds = batch.seconds | {"wait_sampler": waited, "wait_trainer": blocked}
            n_groups = len(batch.rewards)  # every rank's, a multiple of the world size
            if n_groups and not cfg.async_steps:  # the trainer gets the memory; a sleeping vLLM drops its weights
                sampler.sleep()

            # 4. Advantages over the global batch (GDPO's batch step must see every rank's groups).
            conditioned = apply_conditions(batch.rewards, names, conditions)                      # (S, G, R) Eq. 8
            adv_all = REGISTRY[cfg.estimator].advantages(conditioned, weights.to(conditioned.device),
                                                         lengths=batch.lengths, **options)        # (S, G)
            offset = dist.rank() * n_groups // dist.world_size()  # this rank's first group in the global batch
            adv = adv_all[offset:offset + len(batch.prompts)].float().cpu()                       # (this rank's S, G)

            if n_groups == 0:  # --dynamic-sampling at its cap found no group to learn from: no update this step
                totals = None
            else:
                # 5. Micro-batches (minigdpo/microbatch.py); the reference's log-probs (and the old policy's).
                with timed(seconds, "logprob"):
                    groups = list(zip(batch.prompts, batch.completions, adv))
                    if check_due:  # every run checks its fast pass once, at its first update
                        self_check = check_fast_pass(model, ref, groups, cfg, tokenizer.pad_token_id, device, dtype,
                                                     log)
                        check_due = False
                    layout = ("packed" if cfg.padding_free else "padded") if model.fast else None
                    batches = microbatch.cut(groups, cfg, tokenizer.pad_token_id, device, layout)
                    if ref is not None:
                        fill_logprobs(ref, batches, "ref_logp", cfg, reshard=True)
                    elif lora_settings and cfg.beta > 0:
                        with lora.adapters_off(model):
                            fill_logprobs(model, batches, "ref_logp", cfg)
                    if cfg.num_iterations > 1:
                        fill_logprobs(model, batches, "old_logp", cfg)

                # 6. The policy update: num_iterations optimizer steps over the micro-batches (minigdpo/update.py).
                with timed(seconds, "update"):
                    totals = update(model, opt, sched, batches, cfg)

            # 7. The sampler gets the new weights, streamed one whole tensor at a time (with --async-steps, a copy).
            with timed(seconds, "sync"):
                pipe.publish(step, None if totals is None else  # a skipped update leaves the sampler's as they are
                             lambda: model.whole_weights(dtype, adapters_only=sampler.adapters_only))

            # 8. Log, and checkpoint when due. Rewards and lengths describe every completion sampled this step.
            m = reward_metrics(batch.sampled_rewards, names, batch.failures) | batch.stats | self_check | \
                tools.metrics(batch.tools) | {"async/staleness_mean": staleness, "async/staleness_max": staleness}
            self_check = {}  # logged once
            if not cfg.dynamic_sampling:  # what dynamic sampling would have dropped, logged without it too
                m["sampling/uninformative_frac"] = 1 - dynamic_sampling.informative(
                    batch.rewards, names, conditions, weights, cfg).float().mean().item()
            if totals is not None:
                m |= step_metrics(totals) | throughput(batches, model, cfg, flops_per_token, attention_flops, seconds) \
                    | advantage_stats(adv_all, conditioned, names)
                if m["sampler/logp_gap"] > gap_warn and not staleness:  # stale weights widen it: that is async's own
                    log.write(f"warning: step {step}: sampler/trainer log-prob gap {m['sampler/logp_gap']:.3g} > "
                              f"{gap_warn:g} (stale or broken weight sync?)", error=True)
            lens = batch.sampled_lengths
            m |= {"completion/len_mean": lens.mean().item(), "completion/len_max": lens.max().item(),
                  "completion/truncated_frac": batch.truncated.mean().item(), "lr": sched.get_last_lr()[0],
                  "throughput/gen_tokens_per_s": lens.sum().item() / max(seconds["generate"], 1e-9)}
            m |= {f"time/{k}": v for k, v in seconds.items()} | {"time/step": time.perf_counter() - t_end}
            t_end = time.perf_counter()  # time/step: from one step's end to the next's, every wait included
            if device.type == "cuda":  # the step's peak over every phase, this rank's (rank 0 logs)
                m["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                m["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
            log.log(step, m)
            if cfg.samples_every and step % cfg.samples_every == 0 and batch.prompts:
                log.samples(step, [{"prompt": tokenizer.decode(batch.prompts[0], skip_special_tokens=True)[-300:],
                                    "completion": c.text, "advantage": adv[0, i].item(),
                                    **({"conversation": c.messages} if c.messages is not None else {}),
                                    "rewards": dict(zip(names, batch.rewards[offset, i].tolist())),
                                    **({"extra": c.extra} if c.extra else {})}
                                   for i, c in enumerate(batch.completions[0][:4])])
            if (cfg.save_every and step % cfg.save_every == 0) or step == sizes.total_steps:
                save(step, after, pipe.pending(step))
            pipe.step_done(step)

    def save(step, after, pending):
        """Checkpoint `step`, with the batches sampled for the steps after it (--async-steps) and the cursor past
        them; --on-save-error says what a failed write does."""
        try:
            where = checkpoint.save(cfg.output_dir, step, model, opt, sched, tokenizer,
                                    {"cursor": pending[-1][1] if pending else after, **run}, save_dtype,
                                    cfg.keep_checkpoints, export_hf=not lora_settings or cfg.merge_on_save,
                                    pending=pending)
            log.write(f"step {step}: saved {where}")
        except checkpoint.CheckpointError as e:
            log.write(f"error: {e}", error=True)
            if cfg.on_save_error == "stop":
                log.close()
                raise SystemExit(f"stopped at step {step}: the last complete checkpoint is "
                                 f"{checkpoint.latest(cfg.output_dir) or 'none'}") from None

    try:
        with dist.collectives_on(sampling_group):  # the sampling thread's collectives: a group of their own
            pipe.run(train)  # the main thread samples (sample), the trainer trains (train), in turn without async
    finally:  # an error's traceback keeps the closures above alive, and they the sharded state: let go of it here,
        del model, ref, opt, sched  # so that dist.cleanup can end the process group (docs/reliability.md)
        log.close()  # and the bar ends before an error's line, not at exit after it
    dist.print0(start_end_table(log.first, log.recent, names))
    if cfg.final_eval and role != "trainer":  # with the run's own sampler: no second vLLM engine in this process
        import eval as evaluation

        dist.speak()  # a split run's sampling ranks evaluate, and their first one prints
        evaluation.after_training(cfg, sampler, tokenizer)
    dist.barrier()  # every rank got here: main's cleanup may close the connections
    sampler.close()  # a vLLM engine shuts down while the process group it joined is still up


def check_fast_pass(model, ref, groups, cfg, pad_id, device, dtype, log):
    """The fast pass against the model's own forward (logprobs.check_batch: the longest completions of this rank's
    first group, past the smallest window); beyond rounding, the policy and its reference run their own forward."""
    mb = logprobs.check_batch(model, groups, pad_id, device, "packed" if cfg.padding_free else "padded")
    bound = logprobs.FAST_PASS_BOUND[dtype]
    found = logprobs.check_fast_pass(model, mb, cfg.temperature, bound)
    if not model.fast:
        if ref is not None:
            ref.fast = False
        log.write(f"warning: the fast log-prob pass differs from the model's own forward by {found['max']:.3g} at most"
                  f" and {found['mean']:.3g} per token (bounds {bound['max']:g} and {bound['mean']:g}: rounding): the"
                  f" policy and its reference run their own forward from now on", error=True)
    return {f"logprobs/fast_pass_{k}_diff": v for k, v in found.items()}


def rewards_setup(cfg, task, toolbox=None):
    """Reward names (an environment's get_reward last, named after its class), conditions, weights and scorer; any
    bad name or count is a ConfigError."""
    env_rewards = toolbox.env_rewards if toolbox else {}  # an environment's get_reward, a reward the run makes
    specs = (cfg.rewards or task.rewards) + list(env_rewards)
    names = metric_names(specs)
    try:
        if toolbox and not isinstance(task.examples[0]["messages"], list):
            raise ValueError("--tools and --environment need conversational prompts: the chat template writes tools")
        if not names:
            raise ValueError(f"--task {cfg.task} has no rewards of its own: name them with --rewards")
        if len(set(names)) != len(names):
            raise ValueError(f"--rewards lists a reward twice: {names}")
        conditions = [Condition.parse(c, names) for c in cfg.condition]
        apply_conditions(torch.zeros(1, 1, len(names)), names, conditions)  # checks the names
        for flag, values in (("--reward-weights", cfg.reward_weights), ("--saw-shift", cfg.saw_shift)):
            if values and len(values) != len(names):
                raise ValueError(f"{flag} has {len(values)} values for {len(names)} rewards {names}")
        scorer = RewardScorer(specs, timeout=cfg.reward_timeout, own=env_rewards, names=names)
        scorer.check_conversation(task.examples[0]["messages"], tools=bool(toolbox))  # a reward model's template
    except ValueError as e:
        raise config.ConfigError(str(e)) from None
    return names, conditions, torch.tensor(cfg.reward_weights or [1.0] * len(names), dtype=torch.float64), scorer


def main(argv=None):
    """Train; the process group is destroyed on every exit, errors included, once the training state that
    holds it is gone (dist.cleanup says why that order matters)."""
    try:
        run_training(argv)
    except BaseException as e:
        dist.cleanup(e)
        raise
    finally:
        scoring.close_loop()  # the event loop of the run's async rewards and tools, and its thread
    dist.cleanup()


if __name__ == "__main__":
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        main()
    except (config.ConfigError, DataError, SamplerUnavailable, RewardModelError, RewardError, split.SamplerLost) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
