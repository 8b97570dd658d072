"""Measure a base model's pass rate on candidate tasks, to pick a task that gives mixed rewards.

GRPO learns only from groups whose rewards differ, so an RL task must be neither too hard (all
wrong: zero advantage everywhere) nor too easy for the starting model. This script samples
``--group`` responses per prompt with HF ``generate`` (batched, left padding) and prints, per task
and temperature: n samples, pass rate, the share of responses with a non-empty ``\\boxed{}``,
the share of groups with mixed rewards, the mean response length in tokens, and the share cut off
at ``--max-new-tokens`` with no end-of-sequence token (``trunc``). For ``longchain`` also the step
credit v of ``areal_async.reward.running_sum.longchain_steps`` (the value ``reward.graded`` scales):
its mean (``step_v``), its population std within a group averaged over groups (``v_std``), and the
share of groups whose v are not all equal (``v_mixed``: the groups GRPO learns from under graded
rewards); ``nan`` for the other tasks and at T = 0.

Candidate tasks (all with a system prompt and optional few-shot chat demonstrations whose
assistant answers end in ``\\boxed{N}``):
  add1    single-digit addition              "What is 3 + 5?"
  sub1    single-digit subtraction, result ≥ 0
  add2    addition of two numbers below 20
  add2d   addition of two numbers below 100
  sub2d   subtraction of two numbers below 100, result ≥ 0
  mul1    single-digit multiplication
  sum3    sum of three single-digit numbers
  count   "How many words are in this list: ...?" (2–6 words)
  repeat  "Repeat the number 47." (1–2 digits)
  arith   the quickstart task of ``areal_async.data.arith`` (its own prompts and demos)
  longchain  the running sums of ``areal_async.data.longchain`` (answers of hundreds of tokens)
  gsm8k   GSM8K train questions, with GSM8K train answers as demonstrations

Reward: ``areal_async.reward.math.math_reward`` when available, else exact match of the last
``\\boxed{}`` content (commas and whitespace removed).

    python tools/measure_task.py --tasks add1,sub1,count --temperatures 1.0,0 --prompts 64
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import time

import torch

SYSTEM = "You are a helpful assistant. Put the final answer in \\boxed{}."
INSTRUCTION = "Put the final answer in \\boxed{}."
WORDS = "apple river stone cloud green piano tiger lemon chair bread ocean candle".split()


def _arith(rng: random.Random, op: str, hi: int) -> tuple[str, str, str]:
    a, b = rng.randrange(hi), rng.randrange(hi)
    if op == "-":
        a, b = max(a, b), min(a, b)
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    return f"What is {a} {op} {b}?", str(c), f"{a} {op} {b} = {c}. The answer is \\boxed{{{c}}}."


def _sum3(rng: random.Random) -> tuple[str, str, str]:
    a, b, c = (rng.randrange(10) for _ in range(3))
    s, expr = a + b + c, f"{a} + {b} + {c}"
    return f"What is {expr}?", str(s), f"{expr} = {s}. The answer is \\boxed{{{s}}}."


def _count(rng: random.Random) -> tuple[str, str, str]:
    k = rng.randint(2, 6)
    words = rng.sample(WORDS, k)
    q = f"How many words are in this list: {', '.join(words)}?"
    return q, str(k), f"The list has {k} words. The answer is \\boxed{{{k}}}."


def _repeat(rng: random.Random) -> tuple[str, str, str]:
    n = rng.randrange(100)
    return f"Repeat the number {n}.", str(n), f"The number is \\boxed{{{n}}}."


def _gsm8k(rng: random.Random, lines: list[dict]) -> tuple[str, str, str]:
    row = lines[rng.randrange(len(lines))]
    reasoning, gold = row["answer"].split("####")
    gold = gold.strip().replace(",", "")
    steps = reasoning.strip().replace("<<", "[").replace(">>", "]")
    return row["question"], gold, f"{steps}\nThe answer is \\boxed{{{gold}}}."


def make_item(task: str, rng: random.Random, gsm: list[dict]) -> tuple[str, str, str]:
    """One (question, gold, demonstration answer) for ``task``."""
    table = {
        "add1": lambda: _arith(rng, "+", 10),
        "sub1": lambda: _arith(rng, "-", 10),
        "add2": lambda: _arith(rng, "+", 20),
        "add2d": lambda: _arith(rng, "+", 100),
        "sub2d": lambda: _arith(rng, "-", 100),
        "mul1": lambda: _arith(rng, "*", 10),
        "sum3": lambda: _sum3(rng),
        "count": lambda: _count(rng),
        "repeat": lambda: _repeat(rng),
        "gsm8k": lambda: _gsm8k(rng, gsm),
    }
    return table[task]()


def build_prompts(task: str, n: int, few_shot: int, seed: int, gsm: list[dict]):
    """``n`` (messages, gold) pairs; demonstrations come from a separate random stream."""
    if task in ("arith", "longchain"):
        from areal_async.config import DataConfig
        from areal_async.data import load_task

        ds = load_task(DataConfig(task=task, few_shot=few_shot), "test")
        return [(ds.messages(i), ds.gold(i), ds.item(i).row) for i in range(min(n, len(ds)))]
    rng, demo_rng = random.Random(seed), random.Random(seed + 10_000)
    out = []
    for _ in range(n):
        msgs = [{"role": "system", "content": SYSTEM}]
        for _ in range(few_shot):
            q, _, demo = make_item(task, demo_rng, gsm)
            msgs += [{"role": "user", "content": f"{q} {INSTRUCTION}"},
                     {"role": "assistant", "content": demo}]
        q, gold, _ = make_item(task, rng, gsm)
        msgs.append({"role": "user", "content": f"{q} {INSTRUCTION}"})
        out.append((msgs, gold, {}))
    return out


def step_credit(texts: list[str], rows: list[dict], group: int) -> tuple[float, float, float]:
    """``(mean v, mean within-group population std of v, share of groups whose v differ)`` of
    ``longchain_steps``; ``texts`` and ``rows`` in consecutive groups of ``group``."""
    from areal_async.reward.running_sum import longchain_steps

    v = [longchain_steps(t, row) for t, row in zip(texts, rows)]
    if group == 1:
        return sum(v) / len(v), math.nan, math.nan
    groups = [v[i : i + group] for i in range(0, len(v), group)]
    std = [math.sqrt(sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)) for g in groups]
    return sum(v) / len(v), sum(std) / len(std), sum(len(set(g)) > 1 for g in groups) / len(groups)


def _reward_fn():
    try:
        from areal_async.reward.math import math_reward

        return math_reward
    except ImportError:
        return lambda response, gold: float(_last_boxed(response) == gold)


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].replace(",", "").replace(" ", "").strip()
    return None


@torch.no_grad()
def sample(model, tok, prompts: list[list[int]], temperature: float, max_new_tokens: int,
           batch_size: int) -> list[list[int]]:
    """Generate one response per prompt id list; returns output ids without padding or eos."""
    outs: list[list[int]] = []
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s : s + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        kwargs = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        if temperature == 0:
            kwargs = dict(do_sample=False)
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             pad_token_id=pad, eos_token_id=tok.eos_token_id, **kwargs)
        for row in gen[:, width:].tolist():
            if tok.eos_token_id in row:
                row = row[: row.index(tok.eos_token_id)]
            outs.append(row)
    return outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="HF dir or built-in name")
    ap.add_argument("--tasks", default="add1,sub1,count,repeat")
    ap.add_argument("--temperatures", default="1.0,0")
    ap.add_argument("--prompts", type=int, default=64, help="prompts per task")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt at T > 0")
    ap.add_argument("--few-shot", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="torch device of the model, e.g. cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--show", type=int, default=0, help="print this many responses per task")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    from areal_async.config import ModelConfig
    from areal_async.model.source import load_tokenizer, resolve_model_path

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = resolve_model_path(ModelConfig(path=args.model))
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    reward = _reward_fn()
    gsm_path = pathlib.Path(__file__).resolve().parents[1] / "data/gsm8k/train.jsonl"
    gsm = [json.loads(x) for x in gsm_path.read_text().splitlines()]

    rows = []
    for task in args.tasks.split(","):
        items = build_prompts(task, args.prompts, args.few_shot, args.seed, gsm)
        ids = [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for m, _, _ in items]
        for temp in [float(t) for t in args.temperatures.split(",")]:
            group = args.group if temp > 0 else 1
            t0 = time.perf_counter()
            outs = sample(model, tok, [p for p in ids for _ in range(group)], temp,
                          args.max_new_tokens, args.batch_size)
            texts = [tok.decode(o) for o in outs]
            golds = [g for _, g, _ in items for _ in range(group)]
            r = [reward(t, g) for t, g in zip(texts, golds)]
            boxed = [bool(_last_boxed(t)) for t in texts]
            groups = [r[i : i + group] for i in range(0, len(r), group)]
            mixed = (sum(len(set(g)) > 1 for g in groups) / len(groups)) if group > 1 else math.nan
            steps = (step_credit(texts, [row for _, _, row in items for _ in range(group)], group)
                     if task == "longchain" else (math.nan,) * 3)
            rows.append((task, temp, len(r), sum(r) / len(r), sum(boxed) / len(r), mixed,
                         sum(map(len, outs)) / len(outs), time.perf_counter() - t0,
                         sum(map(len, ids)) / len(ids),
                         sum(len(o) >= args.max_new_tokens for o in outs) / len(outs), *steps))
            print(f"# {task} T={temp}: {rows[-1][3]:.3f} in {rows[-1][7]:.0f}s", flush=True)
            for t, g in list(zip(texts, golds))[: args.show]:
                print(f"#   gold={g} response={t!r}")

    print(f"\nmodel={path.name} dtype={args.dtype} few_shot={args.few_shot} "
          f"max_new_tokens={args.max_new_tokens} group={args.group} seed={args.seed}")
    print(f"{'task':8} {'temp':>5} {'n':>5} {'pass':>6} {'boxed':>6} {'mixed_grp':>9} "
          f"{'resp_len':>8} {'trunc':>6} {'prompt_len':>10} {'secs':>6} {'step_v':>6} {'v_std':>6} "
          f"{'v_mixed':>7}")
    for task, temp, n, p, b, m, rl, secs, pl, trunc, sv, sd, sm in rows:
        print(f"{task:8} {temp:5.1f} {n:5d} {p:6.3f} {b:6.3f} {m:9.3f} {rl:8.1f} {trunc:6.3f} "
              f"{pl:10.1f} {secs:6.0f} {sv:6.3f} {sd:6.3f} {sm:7.3f}")


if __name__ == "__main__":
    main()
