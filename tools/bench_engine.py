"""Output tokens/s of the embedded inference server at 1, 8 and 32 concurrent requests.

Starts the real server (engine + aiohttp) in-process, sends real ``/generate`` requests through
``InferenceClient`` (sampled, temperature 1, ``ignore_eos`` so every request makes exactly
``--new-tokens`` tokens), and prints a table. With ``--hf-batch N`` it also times HF ``generate``
on N prompts at once for reference.

    python tools/bench_engine.py --model-path DIR [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import torch

from areal_async.dtypes import FLOAT_DTYPES
from areal_async.inference.client import InferenceClient
from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine


def _prompts(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Natalia sold clips to {i + 3} of her friends. How many clips in all?"}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


async def _bench_server(args, concurrency: list[int]) -> list[tuple[int, int, float]]:
    engine, tokenizer = load_engine(args.model_path, args.dtype, "cpu", max(concurrency), args.max_seq_len)
    rows = []
    async with serve(InferenceServer(engine, tokenizer, args.model_path)) as url:
        client = InferenceClient([url])
        prompts = _prompts(tokenizer, max(concurrency))
        sampling = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 0}
        await client.generate(prompts[0], sampling, "warmup")
        for n in concurrency:
            sampling = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
            start = time.perf_counter()
            results = await asyncio.gather(
                *(client.generate(p, {**sampling, "sampling_seed": i}, f"b{n}-{i}") for i, p in enumerate(prompts[:n]))
            )
            seconds = time.perf_counter() - start
            rows.append((n, sum(len(r.output_ids) for r in results), seconds))
        await client.close()
    return rows


def _bench_hf(args, batch: int) -> tuple[int, int, float]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = FLOAT_DTYPES[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_path)
    tokenizer.padding_side = "left"
    prompts = _prompts(tokenizer, batch)
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, pad_token_id=pad, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **kwargs)
        seconds = time.perf_counter() - start
    return batch, (out.shape[1] - width) * batch, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(FLOAT_DTYPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--hf-batch", type=int, default=8, help="0: skip the HF generate reference")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [("embedded", *r) for r in asyncio.run(_bench_server(args, args.concurrency))]
    if args.hf_batch:
        rows.append(("hf generate", *_bench_hf(args, args.hf_batch)))
    print(f"\n{args.model_path} {args.dtype}, {args.threads} threads, {args.new_tokens} new tokens/request")
    print(f"{'engine':<12} {'concurrent':>10} {'tokens':>7} {'seconds':>8} {'tok/s':>7}")
    for name, n, tokens, seconds in rows:
        print(f"{name:<12} {n:>10} {tokens:>7} {seconds:>8.2f} {tokens / seconds:>7.1f}")


if __name__ == "__main__":
    main()
