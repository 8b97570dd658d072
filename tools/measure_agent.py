"""Base rates of a tool task before training: pass rate, tool-call rate, mixed groups.

Starts one embedded server in this process (the built-in SmolLM2-135M-Instruct unless
``--model-path``; ``--dtype``) and runs the task's test prompts through the default workflow
(``ToolLoop`` over ``--tools``), as the generation worker runs them: ``--group`` episodes per
prompt at each ``--temperatures`` (1.0: the training temperature; 0: greedy, one episode).

Prints one row per temperature: episodes, pass rate, the share that boxed an answer, the share
that called a tool, mean tool calls and model turns, tool errors per episode, the share cut by
``--max-turns``, and (groups > 1) the share of groups whose rewards are not all equal.

    python tools/measure_agent.py [--task calc] [--few-shot 2] [--prompts 48] [--group 4]
        [--temperatures 1.0,0] [--max-new-tokens 48] [--max-turns 3] [--tools calculator]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import time

from areal_async.config import DataConfig, ModelConfig, RewardConfig
from areal_async.data import PromptSet, load_task
from areal_async.embedded.http_server import InferenceServer, serve
from areal_async.embedded.loading import load_engine
from areal_async.inference.client import InferenceClient
from areal_async.model.source import resolve_model_path
from areal_async.reward.math import extract_boxed
from areal_async.reward.pool import RewardPool
from areal_async.rollout.episode import Episode
from areal_async.rollout.workflows import EpisodeItem, ToolLoop
from areal_async.tools import ToolSet
from areal_async.types import sample_seed


def cpu_flags() -> str:
    text = pathlib.Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    keep = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{model} ({', '.join(keep)})"


async def measure(args) -> None:
    path = pathlib.Path(args.model_path) if args.model_path else resolve_model_path(ModelConfig())
    engine, tokenizer = load_engine(str(path), args.dtype, "cpu", args.max_running, 1024)
    prompts = PromptSet(load_task(DataConfig(task=args.task, few_shot=args.few_shot, max_prompt_len=1024), "test"),
                        tokenizer, 1024, 0)
    tools = ToolSet(args.tools.split(",")) if args.tools else None
    print(f"{prompts.summary()}; cpu: {cpu_flags()}", flush=True)
    async with serve(InferenceServer(engine, tokenizer, str(path))) as url, InferenceClient([url]) as client:
        with RewardPool(RewardConfig(num_procs=2)) as rewards:
            workflow = ToolLoop(rewards, prompts.task.reward_fn, tools)
            for temperature in [float(t) for t in args.temperatures.split(",")]:
                group = args.group if temperature > 0 else 1
                t0, done = time.perf_counter(), [0]

                async def episode(j: int, i: int):
                    item = prompts.at(j)
                    messages = prompts.task.messages(item.data_index)
                    ep = Episode(client, tokenizer, prompts.decode, j, i, sample_seed(args.seed, j, i),
                                 item.prompt_ids, messages,
                                 {"temperature": temperature, "stop_token_ids": prompts.stop_token_ids},
                                 server=0, max_new_tokens=args.max_new_tokens, max_turns=args.max_turns)
                    sample = await workflow(ep, EpisodeItem(messages, item.gold, item.row, item.data_index))
                    done[0] += 1
                    if done[0] % 16 == 0:
                        print(f"  T={temperature}: {done[0]}/{n * group} episodes, "
                              f"{time.perf_counter() - t0:.0f} s", flush=True)
                    stats = sample.stats
                    return (sample.correct, bool(ep.turns) and bool(extract_boxed(ep.turns[-1].text)),
                            stats.tool_calls if stats else 0, stats.turns if stats else 1,
                            stats.tool_errors if stats else 0, bool(stats and stats.truncated))

                n = min(args.prompts, len(prompts))
                rows = await asyncio.gather(*(episode(j, i) for j in range(n) for i in range(group)))
                m = len(rows)
                groups = [rows[k:k + group] for k in range(0, m, group)]
                mixed = sum(len({r[0] for r in g}) > 1 for g in groups) / len(groups) if group > 1 else float("nan")
                print(f"| {args.task} ({args.few_shot}) | {temperature} | {m} | {sum(r[0] for r in rows) / m:.3f} | "
                      f"{sum(r[1] for r in rows) / m:.3f} | {sum(r[2] > 0 for r in rows) / m:.3f} | "
                      f"{sum(r[2] for r in rows) / m:.2f} | {sum(r[3] for r in rows) / m:.2f} | "
                      f"{sum(r[4] for r in rows) / m:.3f} | {sum(r[5] for r in rows) / m:.3f} | {mixed:.3f} | "
                      f"{time.perf_counter() - t0:.0f} s |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", default="calc")
    parser.add_argument("--few-shot", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--temperatures", default="1.0,0")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--tools", default="calculator", help="comma-separated; '' for none")
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--dtype", default="bfloat16", help="float32 on CPUs without native bf16")
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("| task (demos) | T | episodes | pass | boxed | called | calls | turns | tool_errors | truncated | "
          "mixed_grp | wall |\n|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    asyncio.run(measure(args))


if __name__ == "__main__":
    main()
