"""tiny-agent: a tiny Llama that calls the calculator task's tool about half the time, built offline in seconds.

build(path) writes a Hugging Face model directory (config, safetensors, tokenizer with a chat template) of a
small Llama taught by supervised fine-tuning, from a random init, on generated conversations of the calculator
task (rewards/calculator.py), such as

    <|im_start|>system\nTools: calculate<|im_end|>
    <|im_start|>user\nWhat is 23*45? Answer as <answer>N</answer>; a calculate tool is there if you need it.<|im_end|>
    <|im_start|>assistant\n<tool_call>{"name": "calculate", "arguments": {"expression": "23*45"}}</tool_call><|im_end|>
    <|im_start|>tool\n1035<|im_end|>
    <|im_start|>assistant\n<answer>1035</answer><|im_end|>

Half of the conversations call the tool (35% of easy ones, 65% of hard ones: CALLS), the other half answer at once:
<answer>N</answer>. The result is a policy with something left to learn by RL: it answers "What is A+B?" (single
digits) right on its own, but cannot multiply two-digit numbers ("What is A*B?"), so there it only gets the answer
by calling the tool, which it does about two times in three. After a tool result it copies the result into its answer. The tests' agent
(tests/test_tools.py) and the CPU example (examples/agent_cpu.py) start from it.

    python examples/tiny_agent.py OUT_DIR      # build (about 20 s on one thread) and measure it
"""

import json
import os
import random
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewards.calculator import INSTRUCTION, calculate  # noqa: E402 (the task's own tool and prompt)

TEMPLATE = (  # Hermes/Qwen-style ChatML with tool calls; tools are listed by name only, to keep prompts short
    "{%- if tools %}{{ '<|im_start|>system\nTools: ' }}"
    "{%- for t in tools %}{{ (t.function or t).name }}{{ ', ' if not loop.last }}{% endfor %}"
    "{{ '<|im_end|>\n' }}{% endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{% set f = c.function or c %}{{ '<tool_call>' }}"
    "{%- if f.arguments is string %}{{ '{\"name\": ' + f.name | tojson + ', \"arguments\": ' + f.arguments + '}' }}"
    "{%- else %}{{ {'name': f.name, 'arguments': f.arguments} | tojson }}{% endif %}"
    "{{- '</tool_call>' }}{% endfor %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CALL_PREFIX = '{"name": "calculate", "arguments": {"expression": "'
# Non-special, so decode(skip_special_tokens=True) keeps them. The tool-call tags are part of the interface;
# the others only shorten the byte-level sequences (a conversation with a tool call: 53 tokens instead of 101),
# which halves the training time: the JSON around the expression, the answer tags, the role names and the
# words every prompt repeats each become one token.
ADDED_TOKENS = ["<tool_call>", "</tool_call>", CALL_PREFIX, '"}}', "<answer>", "</answer>",
                "system", "user", "assistant", "tool", "Tools: ", "calculate", "What is ", " " + INSTRUCTION]
GUESS_WEIGHT = 0.1  # weight of the digits of direct answers to hard questions: noise to a model that cannot multiply
SHAPE = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=1,  # a head of 64:
             num_key_value_heads=1, max_position_embeddings=1024, initializer_range=0.1)  # vLLM's CPU build takes it
STEPS, BATCH, LR = 1000, 16, 3e-3
# How often the conversations call the tool, on easy and on hard problems: half the time in all, a little more on
# hard ones, so that the model has a feature that tells the two apart (with 0.5 and 0.5 RL moved both alike)
CALLS = {False: 0.35, True: 0.65}


def question(rng, hard):
    """(user message, expression): the calculator task's, two digits a number on hard problems."""
    from rewards.calculator import question as task_question

    text, expression, _ = task_question(rng, hard, 2)
    return {"role": "user", "content": text}, expression


def conversation(rng):
    """One training conversation: a question, then either a direct answer or a tool call, result and answer.

    Products of 3 digits are drawn as often as those of 4 (rather than 18% of the time): the model learns to
    copy results of each length on its own, and otherwise copies 3-digit ones far worse (about 60% right)."""
    hard = rng.random() < 0.5
    while True:
        user, expression = question(rng, hard)
        result = calculate(expression)
        if not hard or len(result) == 3 or rng.random() < 0.23:
            break
    answer = {"role": "assistant", "content": f"<answer>{result}</answer>"}
    if rng.random() >= CALLS[hard]:
        return [user, answer]
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": expression}}}
    return [user, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": result}, answer]


def tokenizer():
    from minigdpo.models import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.add_tokens(ADDED_TOKENS)
    tok.chat_template = TEMPLATE
    return tok


def batch(tok, conversations):
    """Right-padded input ids, and a weight for predicting each: 1 for the assistant's tokens (through
    <|im_end|>), 0 for the rest, GUESS_WEIGHT for the digits of direct answers to hard questions."""
    from transformers.utils import get_json_schema

    tools = [get_json_schema(calculate)]  # what apply_chat_template makes of [calculate], made once
    texts = [tok.apply_chat_template(c, tools=tools, tokenize=False) for c in conversations]
    rows = tok(texts)["input_ids"]
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.eos_token_id
    header = tok("assistant\n")["input_ids"]
    ids = torch.full((len(rows), max(map(len, rows))), tok.pad_token_id)
    weights = torch.zeros(ids.shape)
    digits = set(tok.convert_tokens_to_ids(list("0123456789")))
    for i, (row, c) in enumerate(zip(rows, conversations)):
        ids[i, :len(row)] = torch.tensor(row)
        guess = len(c) == 2 and "*" in c[0]["content"]
        learn = False
        for j, t in enumerate(row):
            if t == start and row[j + 1:j + 1 + len(header)] == header:
                learn, begin = True, j + 1 + len(header)
            if learn and j >= begin:
                weights[i, j] = GUESS_WEIGHT if guess and t in digits else 1.0
            if t == end:
                learn = False
    return ids, weights


def build(path, steps=STEPS, seed=0, log=None, **shape):
    """Write the tiny-agent model directory to `path`; returns the training time in seconds (one thread).
    The same seed gives the same weights. `log`, e.g. print, gets the loss every 100 steps; `shape` overrides
    SHAPE."""
    from transformers import LlamaConfig, LlamaForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tok = tokenizer()
        rng = random.Random(seed)
        data = [batch(tok, [conversation(rng) for _ in range(BATCH)]) for _ in range(steps)]
        config = LlamaConfig(vocab_size=len(tok), tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id, bos_token_id=None, **(SHAPE | shape))
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, betas=(0.9, 0.98))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 20) * (1 - s / steps))
        began = time.perf_counter()
        for step, (ids, weights) in enumerate(data):
            logits = model(input_ids=ids[:, :-1]).logits
            losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (losses * weights[:, 1:]).sum() / (weights[:, 1:] > 0).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            if log and (step % 100 == 0 or step == steps - 1):
                log(f"step {step} loss {loss.item():.3f}")
        seconds = time.perf_counter() - began
        model.generation_config.eos_token_id = tok.eos_token_id
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(path)
        tok.save_pretrained(path)
        return seconds
    finally:
        torch.set_num_threads(threads)


def sample(model, tok, prompts, max_new_tokens=100):
    """Completions (text, special tokens dropped) sampled at temperature 1 for a batch of prompt strings."""
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def evaluate(path, n=200, seed=1):
    """Sample n prompts of each kind: tool-call rate, well-formed calls, direct accuracy, copy accuracy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    stats = {}
    for kind in ("easy", "hard"):
        questions = [question(rng, kind == "hard") for _ in range(n)]
        prompts = [tok.apply_chat_template([q], tools=[calculate], tokenize=False, add_generation_prompt=True)
                   for q, _ in questions]
        calls, direct, formed, right, exact, follow = 0, 0, 0, 0, 0, []
        for (q, expression), text in zip(questions, sample(model, tok, prompts)):
            truth = calculate(expression)
            if text.startswith("<tool_call>"):
                calls += 1
                m = re.fullmatch(r"<tool_call>(.*)</tool_call>", text)
                try:
                    f = json.loads(m.group(1))
                    called = f["arguments"]["expression"] if f["name"] == "calculate" else None
                except (AttributeError, ValueError, KeyError, TypeError):
                    called = None
                if isinstance(called, str):
                    exact += called == expression
                    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": called}}}
                    try:
                        result = calculate(called)
                    except (ValueError, SyntaxError) as e:  # what the tool loop turns into an error message
                        result = str({"error": str(e)})
                    follow.append(([q, {"role": "assistant", "content": "", "tool_calls": [call]},
                                    {"role": "tool", "content": result}], result))
            else:
                direct += 1
                formed += re.fullmatch(r"<answer>\d+</answer>", text) is not None
                right += text == f"<answer>{truth}</answer>"
        prompts = [tok.apply_chat_template(c, tools=[calculate], tokenize=False, add_generation_prompt=True)
                   for c, _ in follow]
        answers = sample(model, tok, prompts) if prompts else []
        copied = sum(t == f"<answer>{r}</answer>" for (_, r), t in zip(follow, answers))
        stats[kind] = dict(n=n, tool_call_rate=calls / n, well_formed_of_calls=len(follow) / max(calls, 1),
                           exact_expression_of_calls=exact / max(calls, 1), direct=direct,
                           well_formed_of_direct=formed / max(direct, 1), direct_accuracy=right / max(direct, 1),
                           copy_accuracy=copied / max(len(follow), 1))
    return stats


def cached():
    """The model's folder in minigdpo's model cache (MINIGDPO_CACHE), built there once."""
    from minigdpo.models import build_once

    return build_once("tiny-agent", build)


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "tiny-agent"
    began = time.perf_counter()
    seconds = build(out, log=print)
    print(f"train {seconds:.1f} s, build {time.perf_counter() - began:.1f} s, "
          f"{os.path.getsize(os.path.join(out, 'model.safetensors')) / 1e6:.2f} MB")
    torch.set_num_threads(1)
    for kind, s in evaluate(out).items():
        print(kind, json.dumps({k: round(v, 3) for k, v in s.items()}))
