"""Embedded-engine decode on a Qwen3 shape (random weights, bf16) against HF ``generate``, on one GPU.

    python tools/bench_gpu_engine.py [--shape 0.6b] [--batches 1 16 64 256] [--prompt-len 128]
        [--new-tokens 256] [--hf-batch 256] [--json out.json]

Three parts, one model (the engine's fused projections are views of the HF parameters, so HF
``generate`` runs on exactly the engine's weights):

1. **Correctness.** A few prompts decoded greedily by the engine (batched together) and by HF
   ``generate`` (eager PyTorch, ``sdpa`` attention, no cache tricks); then HF's forward on
   prompt + engine output (teacher forcing) gives, at every generated position, HF's argmax, its
   margin over the engine's token, and HF's log-prob of the engine's token. Random weights give
   nearly flat distributions over 152k tokens, so near-ties are common: a greedy mismatch counts as
   an error only where HF's margin exceeds ``--tie-tol``. Sampled (T = 1) log-probs are compared
   the same way.
   The same greedy prompts through an engine with eager decode steps (``cuda_graph=False``) give
   the eager reference that the graph-replaying engine must equal token for token.
2. **Decode step.** One decode step alone at each batch size, every row at the average context
   (prompt + new/2), timed with device synchronisation: eager (``BatchedForward._decode_step``) and
   replayed CUDA graph (``decode_batch``), beside the roofline floor: (weight bytes + B · context ·
   KV bytes per token) / ``--bandwidth``. Sampling (fused Gumbel-max) is timed separately.
3. **End to end.** ``Engine`` with B requests of ``--prompt-len`` random tokens, ``ignore_eos``,
   ``--new-tokens`` each, sampled at T = 1 with per-request seeds (prefill, scheduling and sampling
   included), and HF ``generate`` (sampling, same shapes) at ``--hf-batch``. With
   ``--deterministic`` the same runs again through a batch-invariant forward (the server's
   ``--enable-deterministic-inference``): its tok/s beside throughput mode's gives the cost of
   deterministic mode, and request 0 (the same prompt and seed at every batch size) must produce
   the same tokens at every batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from areal_async.embedded.engine.engine import Engine
from areal_async.embedded.engine.forward import BatchedForward
from areal_async.embedded.engine.sampling import SamplingParams, sample
from qwen3_shapes import EOS_ID, build_model, kv_bytes_per_token, weight_bytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


async def _engine_generate(forward: BatchedForward, prompts: list[list[int]], params: dict,
                           max_prefill_tokens: int) -> tuple[list, float]:
    engine = Engine(forward, {EOS_ID}, max_prefill_tokens)
    task = asyncio.create_task(engine.run())
    try:
        start = time.perf_counter()
        out = await asyncio.gather(*(
            engine.generate(p, SamplingParams(**params, sampling_seed=i), f"r{i}") for i, p in enumerate(prompts)))
        seconds = time.perf_counter() - start
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return out, seconds


def _teacher_forced(model, prompt: list[int], output: list[int], temperature: float, device) -> dict:
    """HF forward over prompt + output; per generated position: argmax, margin, log-prob of ``output``."""
    ids = torch.tensor([prompt + output], device=device)
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    chosen = torch.tensor(output, device=device)
    top = logits.max(-1).values
    return {
        "argmax": logits.argmax(-1).tolist(),
        "margin": (top - logits.gather(-1, chosen[:, None])[:, 0]).tolist(),
        "logp": logp.gather(-1, chosen[:, None])[:, 0].tolist(),
    }


def check(model, forward, args, device) -> dict:
    vocab = model.config.vocab_size
    prompts = _prompts(args.check_prompts, args.prompt_len, vocab, seed=1)
    greedy, _ = asyncio.run(_engine_generate(
        forward, prompts, dict(max_new_tokens=args.check_tokens, temperature=0.0, ignore_eos=True), 1 << 20))
    with torch.inference_mode():
        hf = model.generate(torch.tensor(prompts, device=device), attention_mask=torch.ones(
            len(prompts), args.prompt_len, dtype=torch.long, device=device), do_sample=False,
            max_new_tokens=args.check_tokens, min_new_tokens=args.check_tokens, pad_token_id=0)
    hf_tokens = hf[:, args.prompt_len:].tolist()
    same_prefix, errors, ties, lp_diff = [], 0, 0, []
    for p, c, ref in zip(prompts, greedy, hf_tokens):
        n = next((i for i, (a, b) in enumerate(zip(c.output_ids, ref)) if a != b), len(ref))
        same_prefix.append(n)
        tf = _teacher_forced(model, p, c.output_ids, 0.0, device)
        for tok, top, margin in zip(c.output_ids, tf["argmax"], tf["margin"]):
            if tok != top:
                ties += margin <= args.tie_tol
                errors += margin > args.tie_tol
        lp_diff += [abs(a - b) for a, b in zip(c.logprobs, tf["logp"])]
    eager_forward = BatchedForward(model, len(prompts), forward.cache.max_seq_len, cuda_graph=False)
    eager, _ = asyncio.run(_engine_generate(
        eager_forward, prompts, dict(max_new_tokens=args.check_tokens, temperature=0.0, ignore_eos=True), 1 << 20))
    del eager_forward
    graph_vs_eager = sum(a != b for c, e in zip(greedy, eager) for a, b in zip(c.output_ids, e.output_ids))
    graph_vs_eager_lp = max(abs(a - b) for c, e in zip(greedy, eager) for a, b in zip(c.logprobs, e.logprobs))
    sampled, _ = asyncio.run(_engine_generate(
        forward, prompts, dict(max_new_tokens=args.check_tokens, temperature=1.0, ignore_eos=True), 1 << 20))
    sp_diff = []
    for p, c in zip(prompts, sampled):
        tf = _teacher_forced(model, p, c.output_ids, 1.0, device)
        sp_diff += [abs(a - b) for a, b in zip(c.logprobs, tf["logp"])]
    return {
        "prompts": len(prompts), "tokens_each": args.check_tokens,
        "greedy_tokens_graph_vs_eager_differ": graph_vs_eager, "greedy_logp_graph_vs_eager_max_abs_diff": graph_vs_eager_lp,
        "greedy_same_prefix_vs_hf_generate": same_prefix,
        "greedy_mismatch_near_tie": ties, "greedy_mismatch_error": errors,
        "greedy_logp_max_abs_diff": max(lp_diff), "greedy_logp_mean_abs_diff": statistics.mean(lp_diff),
        "sampled_logp_max_abs_diff": max(sp_diff), "sampled_logp_mean_abs_diff": statistics.mean(sp_diff),
    }


def _time(fn, reps: int, device) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / reps


def time_decode(model, forward, batch: int, context: int, reps: int, bandwidth: float, device) -> dict:
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (batch,), device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    slots = torch.arange(batch, device=device)  # the eager step at the exact rows and span
    span = forward.cache.max_seq_len if forward.kernels.full_span else context
    eager_s = _time(torch.inference_mode()(lambda: forward._decode_step(tokens, positions, slots, span)), reps, device)
    position_list = positions.tolist()  # decode_batch: tokens on the device, positions host ints
    graph_s = _time(lambda: forward.decode_batch(tokens, position_list), reps, device)
    logits = forward.decode_batch(tokens, position_list).clone()
    temperature = torch.ones(batch, device=device)
    top_p, top_k = torch.ones(batch, device=device), torch.full((batch,), -1, device=device)
    seeds, pos = list(range(batch)), [context] * batch
    sample_s = _time(lambda: sample(logits, temperature, top_p, top_k, seeds, pos), reps, device)
    floor_s = (weight_bytes(model) + batch * context * kv_bytes_per_token(model)) / bandwidth
    return {"batch": batch, "context": context, "eager_ms": eager_s * 1e3, "decode_ms": graph_s * 1e3,
            "sample_ms": sample_s * 1e3, "floor_ms": floor_s * 1e3, "decode_tok_s": batch / graph_s,
            "graphed": forward.graphs is not None}


def time_attention(forward, batch: int, context: int, configs: list[str], reps: int, device) -> list[dict]:
    """The fused decode-attention kernel alone on one layer's cache, each ``BLOCK_N,warps,stages``
    config: ms per call and the K/V bytes it must read per ms (every row at ``context``)."""
    from areal_async.embedded.engine.triton_decode_attention import decode_attention

    cache = forward.cache
    k, v = torch.randn_like(cache.k[0]), torch.randn_like(cache.v[0])
    q = torch.randn(batch, forward.num_heads, forward.head_dim, dtype=forward.dtype, device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    kv_bytes = 2 * batch * forward.num_kv_heads * context * forward.head_dim * k.element_size()
    rows = []
    for text in configs:
        config = tuple(int(x) for x in text.split(","))
        seconds = _time(lambda: decode_attention(q, k, v, positions, forward.scaling, config), reps, device)
        rows.append({"config": text, "batch": batch, "context": context, "ms": seconds * 1e3,
                     "tb_s": kv_bytes / seconds / 1e12})
        print("attention:", json.dumps(rows[-1]), flush=True)
    return rows


def profile_decode(model, forward, batch: int, context: int, device, top: int = 12) -> None:
    """Kernel time of one eager decode step (the GPU work a replayed graph does, without the
    host's launch gaps), by kernel, under ``torch.profiler``."""
    from torch.profiler import ProfilerActivity, profile

    tokens = torch.randint(3, model.config.vocab_size, (batch,), device=device)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    rows, length = forward.decode_shape(batch, context)
    slots = torch.arange(rows, device=device)
    forward._decode_step(tokens, positions, slots, length)
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.inference_mode():
            forward._decode_step(tokens, positions, slots, length)
        _sync(device)
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    print(f"\ndecode step, batch {batch}, context {context}: kernels {busy:.2f} ms in {sum(e.count for e in kernels)} launches")
    for e in kernels[:top]:
        print(f"{e.self_device_time_total / 1e3:>8.3f} ms {e.self_device_time_total / 1e3 / busy:>6.1%} {e.count:>5}x  {e.key[:90]}")


def run_engine(forward, args, vocab: int) -> list[dict]:
    rows = []
    for b in args.batches:
        prompts = _prompts(b, args.prompt_len, vocab, seed=3)  # row 0 is the same prompt at every b
        params = dict(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True)
        out, seconds = asyncio.run(_engine_generate(forward, prompts, params, args.max_prefill_tokens))
        tokens = sum(len(c.output_ids) for c in out)
        rows.append({"batch": b, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
                     "ms_per_step": seconds / args.new_tokens * 1e3, "request0": out[0].output_ids})
        print("engine:", json.dumps({k: v for k, v in rows[-1].items() if k != "request0"}), flush=True)
    return rows


def hf_generate(model, batch: int, args, device) -> dict:
    ids = torch.tensor(_prompts(batch, args.prompt_len, model.config.vocab_size, seed=2), device=device)
    kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kwargs)
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, **kwargs)
        _sync(device)
        seconds = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * batch
    return {"batch": batch, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "ms_per_step": seconds / args.new_tokens * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="0.6b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=16384)
    ap.add_argument("--hf-batch", type=int, nargs="*", default=[256], help="empty: skip HF generate")
    ap.add_argument("--check-prompts", type=int, default=4)
    ap.add_argument("--check-tokens", type=int, default=64)
    ap.add_argument("--tie-tol", type=float, default=0.05, help="logit margin under which a greedy mismatch is a tie")
    ap.add_argument("--decode-reps", type=int, default=20)
    ap.add_argument("--deterministic", action="store_true", help="also run the batch-invariant forward")
    ap.add_argument("--profile", action="store_true",
                    help="kernel times of one eager decode step at the largest batch (what a graph replays)")
    ap.add_argument("--attention-configs", nargs="*", default=["64,4,2", "32,4,2", "64,4,3", "64,8,2", "128,8,2"],
                    help="BLOCK_N,num_warps,num_stages of the decode-attention kernel to time alone")
    ap.add_argument("--bandwidth", type=float, default=4.3e12, help="bytes/s of device memory (measured copy)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(args.shape, dtype, device)
    max_seq_len = args.prompt_len + args.new_tokens
    forward = BatchedForward(model, max(args.batches), max_seq_len)
    report = {"shape": args.shape, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "weight_bytes": weight_bytes(model),
              "kv_bytes_per_token": kv_bytes_per_token(model)}
    report["check"] = check(model, forward, args, device)
    print("correctness:", json.dumps(report["check"]), flush=True)
    context = args.prompt_len + args.new_tokens // 2
    report["decode"] = [time_decode(model, forward, b, context, args.decode_reps, args.bandwidth, device)
                        for b in args.batches]
    if forward.kernels.decode_attention == "triton" and args.attention_configs:
        report["attention"] = time_attention(forward, max(args.batches), context, args.attention_configs,
                                             args.decode_reps, device)
    if args.profile:
        profile_decode(model, forward, max(args.batches), context, device)
    report["engine"] = run_engine(forward, args, model.config.vocab_size)
    if args.deterministic:
        forward = BatchedForward(model, max(args.batches), max_seq_len, batch_invariant=True)
        report["engine_deterministic"] = run_engine(forward, args, model.config.vocab_size)
        del forward
    for key in ("engine", "engine_deterministic"):
        if key in report:
            first = report[key][0]["request0"]
            report[key + "_request0_same_at_every_batch"] = all(r["request0"] == first for r in report[key])
            for r in report[key]:
                r.pop("request0")
    report["hf_generate"] = [hf_generate(model, b, args, device) for b in args.hf_batch]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)

    print(f"\n{args.shape} (random weights, {dtype}), {report['device']}, torch {torch.__version__}")
    print(f"\ndecode step alone, context {context}, floor = (weights {report['weight_bytes'] / 1e9:.2f} GB + "
          f"B·ctx·{report['kv_bytes_per_token']} B) / {args.bandwidth / 1e12:.1f} TB/s")
    print(f"{'batch':>6} {'eager ms':>9} {'graph ms':>9} {'floor ms':>9} {'x floor':>8} {'sample ms':>10} "
          f"{'tok/s (fwd)':>12}")
    for r in report["decode"]:
        print(f"{r['batch']:>6} {r['eager_ms']:>9.2f} {r['decode_ms']:>9.2f} {r['floor_ms']:>9.3f} "
              f"{r['decode_ms'] / r['floor_ms']:>8.1f} {r['sample_ms']:>10.2f} {r['decode_tok_s']:>12.0f}")
    if report.get("attention"):
        print(f"\ndecode attention kernel alone, batch {max(args.batches)}, context {context} (one layer)")
        print(f"{'BLOCK_N,warps,stages':>21} {'ms':>8} {'TB/s':>6}")
        for r in report["attention"]:
            print(f"{r['config']:>21} {r['ms']:>8.4f} {r['tb_s']:>6.2f}")
    print(f"\nend to end: {args.prompt_len}-token prompts, {args.new_tokens} new tokens each, T = 1")
    print(f"{'engine':<12} {'batch':>6} {'tokens':>8} {'seconds':>8} {'tok/s':>9} {'ms/step':>8}")
    for name, rows in (("embedded", report["engine"]), ("deterministic", report.get("engine_deterministic", [])),
                       ("hf generate", report["hf_generate"])):
        for r in rows:
            print(f"{name:<12} {r['batch']:>6} {r['tokens']:>8} {r['seconds']:>8.2f} {r['tok_s']:>9.0f} "
                  f"{r['ms_per_step']:>8.1f}")
    best = {r["batch"]: r["tok_s"] for r in report["engine"]}
    for r in report["hf_generate"]:
        if r["batch"] in best:
            print(f"embedded / hf generate at batch {r['batch']}: {best[r['batch']] / r['tok_s']:.2f}x")
    for det in report.get("engine_deterministic", []):
        print(f"deterministic-mode slowdown at batch {det['batch']}: {best[det['batch']] / det['tok_s']:.2f}x")
    for key in ("engine", "engine_deterministic"):
        if key in report:
            print(f"{key}: request 0 identical at every batch size: {report[key + '_request0_same_at_every_batch']}")


if __name__ == "__main__":
    main()
