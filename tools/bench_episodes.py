"""Multi-turn episodes end to end: rollout speed and prefix-cache hits, then the trainer's tokens.

Starts ``--servers`` embedded servers in this process (throughput mode; the tests' tiny random
Llama, 2 layers, hidden 64, unless ``--model-path``, e.g. ``~/.cache/areal_async/smollm2-135m-instruct``)
and runs ``--groups`` groups x ``--samples`` episodes through the real episode path, all groups at
once: an ``EnvWorkflow`` over an environment that answers each model turn with a user message of
about ``--obs-tokens`` tokens and ends after ``--turns`` model turns; each ``Episode`` is built as
the generation worker builds it (seed ``sample_seed``, every turn to server ``(g * n + i) % servers``),
``--new-tokens`` sampled per turn (EOS ignored unless ``--stop-at-eos``). The group's prompt is a
system and a user message of about ``--prompt-tokens`` tokens. Once with the prefix cache on
("cache on") and once off ("cache off", the server's ``--disable-radix-cache``); the caches are
flushed first, after one warm-up request per server.

Then, on the first setup's samples as ``Trajectory``s, the trainer's plan (``make_plan``, the zero-
advantage skip off) with and without ``trainer.share_prefixes``: sequence tokens (``train/tokens``)
against tokens put through the model (``train/forward_tokens``, from the packed micro-batches).

Prints progress while it runs, then one table: per setup wall seconds, episodes/s, sampled
tokens/s, Σ later_prompt_tokens, Σ later_cached_tokens and ``rollout/prefix_cache_hit`` (their
ratio, turns after the first); per packing the trainer's tokens; with the CPU model and flags and
the command line.

    python tools/bench_episodes.py [--model-path DIR] [--dtype float32] [--servers 2] [--groups 2]
        [--samples 4] [--turns 4] [--prompt-tokens 120] [--new-tokens 24] [--obs-tokens 24]
        [--setups on,off] [--threads 1] [--entries 8] [--stop-at-eos]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pathlib
import shlex
import sys
import tempfile
import time

import numpy as np
import torch

from areal_async.config import AlgoConfig, TrainerConfig
from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from areal_async.inference.client import InferenceClient
from areal_async.rollout.episode import Episode
from areal_async.rollout.workflows import EnvWorkflow, EpisodeItem
from areal_async.trainer.plan import make_plan
from areal_async.types import Array, Trajectory, sample_seed

WORDS = ("apples", "the", "box", "has", "more", "than", "each", "day", "she", "buys", "sold", "cost", "total",
         "how", "many", "left", "after", "week", "money", "dollars", "half", "twice", "pens", "books")
RUN_SEED = 1234
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile")


def text_of_tokens(tokenizer, n: int, rng: np.random.Generator) -> str:
    """Random words, as few as make at least ``n`` tokens."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < n:
        words.append(str(rng.choice(WORDS)))
    return " ".join(words)


class ObsEnv:
    """After each model turn, a user message of about ``obs_tokens`` tokens (drawn from the turn's
    seed); done after ``turns`` model turns; reward per turn: the turn's token count mod 3."""

    def __init__(self, tokenizer, turns: int, obs_tokens: int):
        self.tokenizer, self.turns, self.obs_tokens = tokenizer, turns, obs_tokens

    def reset(self, item: EpisodeItem, seed: int):
        return None  # the group's prompt

    def step(self, action):
        done = action.turn + 1 >= self.turns
        reward = float(len(action.ids) % 3) + (action.ids[0] % 2 if action.ids else 0)
        if done:
            return None, reward, True
        text = text_of_tokens(self.tokenizer, self.obs_tokens, np.random.default_rng(action.seed))
        return [{"role": "user", "content": text}], reward, False


def group_prompts(args, tokenizer) -> list[tuple[list[dict], list[int]]]:
    """Each group's chat messages and their ids with the generation prompt."""
    out = []
    for g in range(args.groups):
        text = text_of_tokens(tokenizer, args.prompt_tokens, np.random.default_rng(g))
        messages = [{"role": "system", "content": "You are a helpful assistant."},
                    {"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append((messages, ids))
    return out


async def run_setup(args, model: str, cache: bool) -> dict:
    """One setup: every group at once; returns timings, token counts and the ``Trajectory``s."""
    name = "cache on" if cache else "cache off"
    engines = [load_engine(model, args.dtype, "cpu", args.slots, args.max_seq_len, prefix_cache=cache,
                           prefix_cache_entries=args.entries) for _ in range(args.servers)]
    tokenizer = engines[0][1]
    servers = [InferenceServer(e, tok, model) for e, tok in engines]
    tasks = [asyncio.create_task(e.run()) for e, _ in engines]
    prompts = group_prompts(args, tokenizer)
    workflow = EnvWorkflow(lambda: ObsEnv(tokenizer, args.turns, args.obs_tokens))
    stop_ids = sorted({tokenizer.eos_token_id} - {None})
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "stop_token_ids": stop_ids}
    if not args.stop_at_eos:
        sampling["ignore_eos"] = True

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    try:
        async with contextlib.AsyncExitStack() as stack:
            urls = [await stack.enter_async_context(serve(server)) for server in servers]
            client = await stack.enter_async_context(InferenceClient(urls))
            for k in range(args.servers):  # warm-up, then empty caches
                await client.generate(prompts[0][1][:8], {"max_new_tokens": 2}, f"warm{k}", server=k)
            await client.flush_cache()
            t0 = time.perf_counter()
            done = 0

            async def episode(g: int, i: int):
                messages, ids = prompts[g]
                ep = Episode(client, tokenizer, decode, g, i, sample_seed(RUN_SEED, g, i), ids, messages, sampling,
                             server=(g * args.samples + i) % len(client.urls), max_new_tokens=args.new_tokens,
                             max_turns=args.turns)
                sample = await workflow(ep, EpisodeItem(messages, "", {}, g))
                sample.check()
                return sample

            async def group(g: int) -> Trajectory:
                nonlocal done
                samples = await asyncio.gather(*(episode(g, i) for i in range(args.samples)))
                done += 1
                print(f"  [{name}] group {g} done ({done}/{args.groups}) at {time.perf_counter() - t0:.1f} s",
                      flush=True)
                return Trajectory(group_id=g, prompt_ids=Array.of(prompts[g][1], "int32"), samples=list(samples),
                                  data_index=g)

            trajs = await asyncio.gather(*(group(g) for g in range(args.groups)))
            wall = time.perf_counter() - t0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    samples = [s for t in trajs for s in t.samples]
    sampled = sum(int(s.sampled().sum()) + sum(int(seg.sampled().sum()) for seg in s.segments) for s in samples)
    later_prompt = sum(s.stats.later_prompt_tokens for s in samples)
    later_cached = sum(s.stats.later_cached_tokens for s in samples)
    unsampled = sum(len(s.output_ids.numpy()) - int(s.sampled().sum()) for s in samples)
    return {"name": name, "wall": wall, "between": unsampled / max(1, len(samples) * (args.turns - 1)),
            "episodes": len(samples), "sampled": sampled, "later_prompt": later_prompt, "later_cached": later_cached,
            "trajs": list(trajs), "prompt_len": len(prompts[0][1]),
            "seq_len": np.mean([len(t.prompt_ids.numpy()) + len(s.output_ids.numpy())
                                for t in trajs for s in t.samples])}


def trainer_tokens(trajs: list[Trajectory], share: bool, max_tokens_per_mb: int) -> dict:
    """``train/tokens`` and ``train/forward_tokens`` of one step over ``trajs`` (one rank)."""
    trainer = TrainerConfig(share_prefixes=share, skip_zero_advantage=False, max_tokens_per_mb=max_tokens_per_mb)
    plan = make_plan(trajs, AlgoConfig(), trainer, "cpu")
    forward = sum(mb.pack(idx).num_tokens for mb in plan.minibatches for idx in mb.seq_index if idx)
    return {"tokens": plan.tokens, "forward": forward, "micro_batches": plan.num_micro_batches,
            "sequences": sum(len(idx) for mb in plan.minibatches for idx in mb.seq_index)}


def cpu_info() -> tuple[str, str]:
    """The CPU model name and which of ``FLAGS`` /proc/cpuinfo lists."""
    model, flags = "unknown", set()
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return model, " ".join(f"{f}{'+' if f in flags else '-'}" for f in FLAGS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="an HF directory (default: the tests' tiny random Llama)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--samples", type=int, default=4, help="episodes per group")
    p.add_argument("--turns", type=int, default=4, help="model turns per episode")
    p.add_argument("--prompt-tokens", type=int, default=120, help="about this many tokens of user prompt")
    p.add_argument("--new-tokens", type=int, default=24, help="sampled tokens per turn")
    p.add_argument("--obs-tokens", type=int, default=24, help="about this many tokens per observation message")
    p.add_argument("--setups", default="on,off", help="prefix cache on / off, in this order")
    p.add_argument("--slots", type=int, default=16, help="max running requests per server")
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--entries", type=int, default=8, help="prefix cache rows per server")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-tokens-per-mb", type=int, default=4096, help="the trainer's micro-batch budget")
    p.add_argument("--stop-at-eos", action="store_true", help="let turns end at EOS (default: exactly --new-tokens)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not setups or set(setups) - {"on", "off"}:
        p.error(f"--setups {args.setups!r}: a comma list of 'on' and 'off'")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path
        if model is None:
            from tests.support.models import build_tiny_model
            model = str(build_tiny_model(pathlib.Path(tmp) / "tiny-llama"))
        for s in setups:
            print(f"setup: cache {s} ({args.groups} groups x {args.samples} episodes x {args.turns} turns, "
                  f"{args.servers} servers)", flush=True)
            results.append(asyncio.run(run_setup(args, model, s == "on")))
            r = results[-1]
            print(f"  [{r['name']}] {r['wall']:.1f} s, hit {r['later_cached'] / max(r['later_prompt'], 1):.3f}",
                  flush=True)
    print("trainer plan: share_prefixes off / on", flush=True)
    trajs = results[0]["trajs"]
    plans = {share: trainer_tokens(trajs, share, args.max_tokens_per_mb) for share in (False, True)}

    cpu, flags = cpu_info()
    first = results[0]
    print()
    print(f"command: {shlex.join([pathlib.Path(sys.executable).name] + sys.argv)}")
    print(f"cpu: {cpu}; {flags}; torch threads {args.threads}; {args.dtype}")
    print(f"model: {args.model_path or 'tiny random Llama (2 layers, hidden 64)'}; {args.servers} servers, "
          f"{args.groups} groups x {args.samples} episodes x {args.turns} turns, {args.new_tokens} new tokens/turn, "
          f"group prompt {first['prompt_len']} tokens, {first['between']:.1f} tokens between turns (observation "
          f"message + template), "
          f"mean sequence {first['seq_len']:.0f} tokens")
    print(f"| {'rollout setup':<13} | {'episodes':>8} | {'wall s':>7} | {'episodes/s':>10} | {'sampled tok/s':>13} "
          f"| {'later prompt':>12} | {'later cached':>12} | {'prefix_cache_hit':>16} |")
    print(f"|{'-' * 15}|{'-' * 9}:|{'-' * 8}:|{'-' * 11}:|{'-' * 14}:|{'-' * 13}:|{'-' * 13}:|{'-' * 17}:|")
    for r in results:
        print(f"| {r['name']:<13} | {r['episodes']:>8} | {r['wall']:>7.2f} | {r['episodes'] / r['wall']:>10.2f} "
              f"| {r['sampled'] / r['wall']:>13.1f} | {r['later_prompt']:>12} | {r['later_cached']:>12} "
              f"| {r['later_cached'] / max(r['later_prompt'], 1):>16.3f} |")
    print(f"| {'trainer (' + first['name'] + ' samples)':<28} | {'sequences':>9} | {'micro-batches':>13} "
          f"| {'train/tokens':>12} | {'train/forward_tokens':>20} | {'forwarded':>9} |")
    print(f"|{'-' * 30}|{'-' * 10}:|{'-' * 14}:|{'-' * 13}:|{'-' * 21}:|{'-' * 10}:|")
    for share, r in plans.items():
        print(f"| {'share_prefixes ' + ('on' if share else 'off'):<28} | {r['sequences']:>9} | "
              f"{r['micro_batches']:>13} | {r['tokens']:>12} | {r['forward']:>20} | "
              f"{r['forward'] / r['tokens']:>9.3f} |")


if __name__ == "__main__":
    main()
