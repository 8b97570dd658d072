"""A single-process GRPO loop with HF ``generate``, to choose a learning rate for a task quickly.

Not the training pipeline: no servers, queue or packing. Each step samples ``--groups`` prompts
(in order from the task's train split, after a seeded shuffle) × ``--n`` responses at
temperature 1.0 from the current fp32 policy, scores them with ``math_reward``, computes GRPO
group advantages, and takes one AdamW step on the on-policy decoupled-PPO loss (prox = behav =
the sampling policy, so the ratio is 1 and the loss is the token-mean policy gradient), with
the same clipping and token-mean aggregation as the trainer. Prints the pass rate per step.

    python tools/grpo_probe.py --task arith --few-shot 3 --lr 1e-5 --steps 8
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from areal_async.algo.advantages import group_advantages
from areal_async.algo.loss import decoupled_ppo_loss
from areal_async.config import DataConfig, ModelConfig
from areal_async.data import load_task
from areal_async.model.source import load_tokenizer, resolve_model_path
from areal_async.reward.math import math_reward


def token_logprobs(model, seqs: list[list[int]], prompt_lens: list[int], temperature: float):
    """Per-response-token log-probs, concatenated over sequences: ``[T] float32``."""
    out = []
    for ids, p in zip(seqs, prompt_lens):
        if len(ids) == p:
            continue
        logits = model(torch.tensor([ids])).logits[0, p - 1 : -1].float() / temperature
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[p:])[:, None])[:, 0])
    return torch.cat(out) if out else torch.zeros(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--task", default="arith")
    ap.add_argument("--few-shot", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = resolve_model_path(ModelConfig(path=args.model))
    tok = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    task = load_task(DataConfig(task=args.task, few_shot=args.few_shot), "train")
    order = list(range(len(task)))
    random.Random(args.seed).shuffle(order)
    eos = tok.eos_token_id

    for step in range(args.steps):
        t0 = time.perf_counter()
        idx = order[step * args.groups : (step + 1) * args.groups]
        prompts = [tok(tok.apply_chat_template(task.messages(i), add_generation_prompt=True,
                                               tokenize=False), add_special_tokens=False)
                   ["input_ids"] for i in idx]
        width = max(map(len, prompts))
        batch = [p for p in prompts for _ in range(args.n)]
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch])
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in batch])[:, None])
        model.eval()
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=True,
                                 temperature=args.temperature, top_k=0, top_p=1.0,
                                 max_new_tokens=args.max_new_tokens, pad_token_id=eos,
                                 eos_token_id=eos)
        responses = []
        for row in gen[:, width:].tolist():
            responses.append(row[: row.index(eos) + 1] if eos in row else row)
        golds = [task.gold(i) for i in idx for _ in range(args.n)]
        correct = torch.tensor([math_reward(tok.decode(r, skip_special_tokens=True), g)
                                for r, g in zip(responses, golds)])
        gen_s = time.perf_counter() - t0

        model.train()
        rewards = correct * 10.0 - 5.0  # +5 / -5
        adv_seq = group_advantages(rewards, args.n)
        seqs = [p + r for p, r in zip(batch, responses)]
        plens = list(map(len, batch))
        theta = token_logprobs(model, seqs, plens, args.temperature)
        behav = theta.detach()  # one update per batch: the sampling policy is the current one
        adv = torch.cat([adv_seq[k].expand(len(r)) for k, r in enumerate(responses) if r])
        loss, stats = decoupled_ppo_loss(theta, behav, behav, adv, torch.ones_like(adv))
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        groups = correct.view(-1, args.n)
        mixed = ((groups.min(1).values != groups.max(1).values).float().mean().item())
        print(f"step {step} lr {args.lr:g} pass {correct.mean().item():.3f} mixed {mixed:.2f} "
              f"resp_len {sum(map(len, responses)) / len(responses):.1f} "
              f"grad_norm {grad_norm.item():.2f} gen_s {gen_s:.0f} "
              f"step_s {time.perf_counter() - t0:.0f}", flush=True)


if __name__ == "__main__":
    main()
