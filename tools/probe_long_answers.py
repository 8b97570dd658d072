"""Probe whether a model can write long exact answers: two tasks simpler than ``longchain``.

    count  "Write every number from a to b, one per line, then put the last one in \\boxed{}."
           (40-100 numbers, a in 10..300); exact: the whole answer, every line, is right.
    step   "Start at s and keep adding k, writing every total, until the total is more than t."
           (25 steps of k in 1, 2, 5, 10); exact: the final \\boxed{} total is right.

One demonstration of the same task (16 lines) as an earlier chat turn, HF ``generate`` on the CPU,
small samples: a first look, not a calibration (``tools/measure_task.py`` is that).

    python tools/probe_long_answers.py --task count --n 8 --temperature 1.0
"""

from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run as a script: the repository's package
from areal_async.config import ModelConfig  # noqa: E402
from areal_async.model.source import load_tokenizer, resolve_model_path  # noqa: E402
from areal_async.reward.math import math_reward  # noqa: E402

SYSTEM = "You are a helpful assistant. Put the final answer in \\boxed{}."


def count_item(a: int, b: int) -> tuple[str, str]:
    """(question, exact answer) of counting from ``a`` to ``b``."""
    q = f"Write every number from {a} to {b}, one per line, then put the last one in \\boxed{{}}."
    return q, "\n".join(str(i) for i in range(a, b + 1)) + f"\n\\boxed{{{b}}}"


def step_item(s: int, k: int, n: int) -> tuple[str, str]:
    """(question, demonstration answer) of adding ``k`` to ``s`` ``n`` times."""
    q = (f"Start at {s} and keep adding {k}, writing every total, until the total is more than "
         f"{s + n * k - 1}. Put the final answer in \\boxed{{}}.")
    lines = [f"{s + i * k} + {k} = {s + (i + 1) * k}" for i in range(n)]
    return q, "\n".join(lines) + f"\nThe answer is \\boxed{{{s + n * k}}}."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", choices=["count", "step"], default="count")
    ap.add_argument("--n", type=int, default=8, help="prompts, one sample each")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=420)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    path = resolve_model_path(ModelConfig(path="smollm2-135m-instruct"))
    tok = load_tokenizer(path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    rng = random.Random(1)
    demo = count_item(37, 52) if args.task == "count" else step_item(23, 4, 16)
    items = []
    for i in range(args.n):
        if args.task == "count":
            a = rng.randint(10, 300)
            items.append(count_item(a, a + rng.randint(40, 100)))
        else:
            items.append(step_item(rng.randint(1, 60), (1, 2, 5, 10)[i % 4], 25))
    texts = [tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": demo[0]},
                                      {"role": "assistant", "content": demo[1]}, {"role": "user", "content": q}],
                                     add_generation_prompt=True, tokenize=False) for q, _ in items]
    enc = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width, pad = max(map(len, enc)), tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + e for e in enc])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=True,
                         temperature=args.temperature, top_k=0, top_p=1.0, pad_token_id=pad,
                         eos_token_id=tok.eos_token_id)
    right = 0
    for row, (_, gold) in zip(out[:, width:].tolist(), items):
        if tok.eos_token_id in row:
            row = row[: row.index(tok.eos_token_id)]
        text = tok.decode(row)
        ok = (text.strip() == gold if args.task == "count"
              else math_reward(text, gold.rsplit("{", 1)[1].rstrip("}.")) == 1.0)
        right += ok
        print(f"# tokens={len(row)} right={ok} tail={text[-60:]!r}")
    print(f"{args.task} T={args.temperature}: {right} / {args.n} right in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
