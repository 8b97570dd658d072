"""Seconds per training step and tokens through the model, exact savings off and on, in one run.

    python tools/bench_trainer.py [--shape quickstart] [--model smollm2-135m-instruct] [--steps 3]
    python tools/bench_trainer.py --shape gpu --device cuda --dtype bfloat16 [--max-tokens-per-mb 32768]
    python tools/bench_trainer.py --shape synthetic --groups 8 --n-samples 4 --prompt-len 150 --response-len 200
    torchrun --nproc-per-node 2 tools/bench_trainer.py ...   # 2 ranks (gloo on CPU)

Batch shapes (``--shape``):

- ``quickstart``: the CPU quickstart's step (``configs/quickstart_cpu.yaml``): 8 groups × 4
  samples of the real task's prompts (``data/arith.py``, 3 few-shot demonstrations, the model's
  own chat template and tokenizer, prompts of group ids ``step·8 …``), responses of 15–27 random
  tokens ending in the end-of-turn token (mean 21, as measured in the quickstart; random tokens
  share nothing beyond the prompt, so no sharing is credited that a real batch might not have);
  ``--zero-groups`` of the groups (default half, as measured) have all-equal rewards.
- ``gpu``: a GRPO shape for one GPU: 32 groups × 8 samples, random prompts of 512–1024 tokens,
  responses of 256–1024.
- ``synthetic``: ``--groups × --n-samples``, random prompts of ``--prompt-len``, responses of
  ``--response-len``/2 … ``--response-len``.

Each step runs ``train_step`` (packing, decoupled-PPO forward/backward, AdamW) once with the
savings off (``trainer.skip_zero_advantage=false``, ``trainer.share_prefixes=false``) and once on,
on the same batch, alternating (A/B interleaved, so machine load hits both alike; ``--breakdown``
adds each saving alone; ``--tree-attention varlen,flex`` runs "on" with ``trainer.tree_attention``
varlen and adds ``on:flex``, the same with flex), then one full-parameter gather as the weight sync does. The learning
rate is 0, so all variants see the same weights and print the same loss and gradient norm up to
fp32 rounding. "Off" still has the balanced allocator and the LM head at loss positions only. The
first step is warm-up and left out of the medians. Prints per step and variant the seconds, the
tokens forwarded, the loss and the gradient norm, then the median seconds and the ratios.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from areal_async.config import AlgoConfig, DataConfig, ModelConfig, TrainerConfig
from areal_async.trainer.policy import build_policy, full_parameters, hf_model, init_distributed
from areal_async.trainer.step import train_step
from areal_async.types import Array, Sample, Trajectory


def _rewards(rng: np.random.Generator, n: int, all_equal: bool) -> list[float]:
    """±5 rewards of one group: all equal, or mixed (at least one of each)."""
    if all_equal:
        return [5.0 if rng.random() < 0.5 else -5.0] * n
    r = [5.0 if rng.random() < 0.5 else -5.0 for _ in range(n)]
    r[0], r[1] = 5.0, -5.0
    return list(rng.permutation(r))


def make_batch(prompts: list[list[int]], n: int, response_lens: tuple[int, int], vocab: int, eos: int | None,
               zero_groups: float, rng: np.random.Generator) -> list[Trajectory]:
    """Trajectories of ``len(prompts)`` groups × ``n`` samples: random response tokens (last one
    ``eos`` when given), random behaviour log-probs, ``round(zero_groups · groups)`` groups with
    all-equal rewards."""
    groups = len(prompts)
    zero = set(rng.permutation(groups)[: round(zero_groups * groups)].tolist())
    out = []
    for g, prompt in enumerate(prompts):
        samples = []
        for i, reward in enumerate(_rewards(rng, n, g in zero)):
            ids = rng.integers(0, vocab, int(rng.integers(response_lens[0], response_lens[1] + 1)))
            if eos is not None:
                ids[-1] = eos
            samples.append(Sample(
                index=i, seed=i, output_ids=Array.of(ids, "int32"),
                behav_logprobs=Array.of(-rng.uniform(0.1, 3.0, len(ids)), "float32"),
                versions=Array.of(np.zeros(len(ids)), "int32"), finish_reason="stop", reward=float(reward)))
        out.append(Trajectory(group_id=g, prompt_ids=Array.of(np.asarray(prompt), "int32"), samples=samples,
                              data_index=g))
    return out


class QuickstartPrompts:
    """The quickstart task's training prompts through the model's tokenizer (group ids in order)."""

    def __init__(self, model_dir: str, seed: int = 1):
        from areal_async.data import PromptSet, load_task
        from areal_async.model.source import load_tokenizer

        data = DataConfig(task="arith", few_shot=3, max_prompt_len=384)
        self.tokenizer = load_tokenizer(model_dir)
        self.prompts = PromptSet(load_task(data, "train"), self.tokenizer, data.max_prompt_len, seed)

    def batch(self, step: int, groups: int) -> list[list[int]]:
        return [self.prompts.for_group(step * groups + g).prompt_ids for g in range(groups)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct", help="HF directory or built-in model name")
    ap.add_argument("--shape", default="quickstart", choices=["quickstart", "gpu", "synthetic"])
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n-samples", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=150)
    ap.add_argument("--response-len", type=int, default=200)
    ap.add_argument("--zero-groups", type=float, default=0.5, help="fraction of groups with all-equal rewards")
    ap.add_argument("--steps", type=int, default=3, help="steps per variant; the first is warm-up")
    ap.add_argument("--max-tokens-per-mb", type=int, default=None,
                    help="default: 512 (the quickstart's) for quickstart, 32768 for gpu, 4096 for synthetic")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--parallel", default="fsdp2", choices=["fsdp2", "ddp"])
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    ap.add_argument("--breakdown", action="store_true", help="also each saving alone (variants skip, share)")
    ap.add_argument("--tree-attention", default="auto",
                    help="trainer.tree_attention of the variants with share_prefixes; a comma list (e.g. "
                         "varlen,flex) adds a variant on:<path> per further path")
    args = ap.parse_args()
    tree_paths = args.tree_attention.split(",")
    if not set(tree_paths) <= {"auto", "varlen", "flex", "sdpa"} or len(set(tree_paths)) < len(tree_paths):
        raise ValueError(f"--tree-attention {args.tree_attention}: distinct values of auto, varlen, flex, sdpa")
    if args.max_tokens_per_mb is None:
        args.max_tokens_per_mb = {"quickstart": 512, "gpu": 32768, "synthetic": 4096}[args.shape]
    torch.set_num_threads(args.threads)
    from areal_async.model.source import resolve_model_path

    model_dir = str(resolve_model_path(ModelConfig(path=args.model)))
    device = init_distributed(args.device)
    base = TrainerConfig(max_tokens_per_mb=args.max_tokens_per_mb, dtype=args.dtype, parallel=args.parallel, lr=1e-6,
                         tree_attention=tree_paths[0])
    variants = {"off": msgspec.structs.replace(base, skip_zero_advantage=False, share_prefixes=False),
                "on": msgspec.structs.replace(base, skip_zero_advantage=True, share_prefixes=True)}
    if args.breakdown:
        variants.update(skip=msgspec.structs.replace(base, skip_zero_advantage=True, share_prefixes=False),
                        share=msgspec.structs.replace(base, skip_zero_advantage=False, share_prefixes=True))
    for path in tree_paths[1:]:  # the same savings as "on", another tree attention path
        variants[f"on:{path}"] = msgspec.structs.replace(variants["on"], tree_attention=path)
    policy = build_policy(model_dir, base, device)
    # lr 0: the weights stay put (AdamW's work is still done), so both variants see the same
    # policy and their loss and gradient norm must agree, a check of the savings' exactness
    optimizer = torch.optim.AdamW(policy.parameters(), lr=0.0)
    vocab = hf_model(policy).config.vocab_size
    rank = dist.get_rank()
    source = QuickstartPrompts(model_dir) if args.shape == "quickstart" else None
    times: dict[str, list[float]] = {k: [] for k in variants}
    for step in range(args.steps):
        rng = np.random.default_rng(step)
        if args.shape == "quickstart":
            batch = make_batch(source.batch(step, 8), 4, (15, 27), vocab, source.tokenizer.eos_token_id,
                               args.zero_groups, rng)
        elif args.shape == "gpu":
            prompts = [rng.integers(0, vocab, int(rng.integers(512, 1025))).tolist() for _ in range(32)]
            batch = make_batch(prompts, 8, (256, 1024), vocab, None, args.zero_groups, rng)
        else:
            prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.groups)]
            batch = make_batch(prompts, args.n_samples, (args.response_len // 2, args.response_len), vocab, None,
                               args.zero_groups, rng)
        for name, cfg in variants.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = train_step(policy, optimizer, batch, AlgoConfig(), cfg, 1.0, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            for _ in full_parameters(policy):
                pass
            if step > 0:
                times[name].append(t1 - t0)
            if rank == 0:
                print(f"step {step} savings {name:9s}: train {t1 - t0:7.2f} s, {int(m['train/tokens'])} sequence "
                      f"tokens, {int(m['train/forward_tokens'])} forwarded, {int(m['train/skipped_seqs'])} "
                      f"sequences skipped, loss {m['train/loss']:+.8e}, grad_norm {m['train/grad_norm']:.8e}"
                      f"{' (warm-up)' if step == 0 else ''}", flush=True)
    if rank == 0:
        if args.steps > 1:
            median = {k: statistics.median(v) for k, v in times.items()}
            print("median s/step: " + ", ".join(f"{k} {v:.2f}" for k, v in median.items())
                  + "; ratio off/on " + f"{median['off'] / median['on']:.2f}x"
                  + "".join(f", off/{k} {median['off'] / median[k]:.2f}x" for k in median if k not in ("off", "on"))
                  + f" ({args.shape} shape, {args.dtype}, {device.type}, {torch.get_num_threads()} threads)")
        print(f"peak RSS rank 0: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB "
              f"(world size {dist.get_world_size()})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
