"""A whole GRPO job on one GPU, engine and trainer side by side, at an 8B-class shape; one table.

    PYTHONPATH=. python tools/bench_lora_job.py [--shape 8b] [--device cuda] [--steps 20]
        [--groups 32 --samples 8] [--prompt-len 512,1024] [--response-len 256,1024]
        [--max-running N] [--budget-s 500] [--json FILE] [override ...]   # e.g. trainer.lora.rank=32

    # the CPU check of the whole path (tiny shape, full fine-tuning, about a minute on 2 cores):
    PYTHONPATH=. python tools/bench_lora_job.py --shape tiny --device cpu --steps 2

What runs: ``python -m launcher.local`` on a config this script writes (``WORK/job.yaml``, printed):
one embedded server and one trainer rank on the same device, ``queue.max_staleness=1``, disk weight
sync, no evaluation, no checkpoint but the final one. The model is ``--shape`` of
``tools/qwen3_shapes.py`` with random weights, written to ``--model-dir`` unless a model is there.
Overrides (``section.key=value``) are forwarded to the launcher after the script's own keys, so
they win: LoRA is asked for as ``trainer.lora.rank=32 trainer.lora.alpha=64`` (whatever the
trainer's config accepts); nothing here knows LoRA but the FLOPs below.

The synthetic task (``data.task=file``, rows written to ``WORK/prompts.jsonl``): each row a prompt
of random digits whose chat-templated length is drawn uniformly from ``--prompt-len`` (exactly, with
the model directory's tokenizer, the way ``data/prompts.py`` counts it); ``--steps + 2`` batches of
distinct rows, so the servers' prefix cache serves nothing across groups. Each sample's response
budget is drawn uniformly from ``--response-len`` by the workflow ``run`` below (one OpenAI-client
call with ``max_tokens``: needs the ``openai`` package on the machine); random weights almost never
sample the end token, so responses run to their budget. With a fixed ``--response-len N,N`` the
workflow is ``FixedLengthEpisode`` (one answer of ``rollout.max_new_tokens=N``, no ``openai``). The
reward is uniform in [0, 1) per sample: GRPO advantages are never all zero, so
``trainer.skip_zero_advantage`` skips nothing (the table's ``skipped`` column checks it); prompts
are still shared by each group's samples (``trainer.share_prefixes``), as in any GRPO job.

The table, over the steps after the first ``--skip-steps`` (start-up, compilation and the first
batch's wait left out), read from the run's ``metrics.jsonl`` and ``trajectories.jsonl``:

- **s/step**: wall seconds between the end of step ``skip - 1`` and the last step's end, per step;
  **train s**: mean ``perf/train_s`` (the trainer's update, optimizer included);
- **gen tok/s**: sampled tokens of those batches (``rollout/response_len`` × samples) per wall
  second: the rate generation fed training (η = 1: the engine generates the next batch meanwhile);
- **trained tok/s**: Σ ``train/tokens`` (each sequence's prompt and response, shared prompts
  counted per sequence) per wall second;
- **peak GiB**: the most device memory each process held (``nvidia-smi --query-compute-apps``
  every 0.5 s; engine: the ``areal_async.embedded.server`` process, trainer: the
  ``areal_async.trainer.main`` rank), and of the whole device (``memory.used``);
- **MFU**: ``areal_async.flops.train_flops`` of the tokens the trainer ran (``train/forward_tokens``,
  the attention pairs of each group as a prefix tree), summed, over Σ ``perf/train_s`` and the peak
  (``--peak-tflops``, the H200's dense bf16 datasheet 989 TFLOP/s as in
  ``tools/bench_gpu_trainer.py``). LoRA's FLOPs (4·N_base + 6·N_adapter per token) are used when
  the run's resolved config (``RUN_DIR/config.yaml``) has ``trainer.lora.rank`` > 0, with its
  ``target_modules`` (``all-linear`` when absent); otherwise 6·N. The proximal and reference
  forwards, the optimizer and recomputation are not counted.

``--budget-s`` (default 500): the launcher is stopped (SIGINT, as Ctrl-C; killed 45 s later if still
there) when that many seconds have passed since the script started, and the table is made from the
steps logged by then, so that one device call of 600 s prints a table whatever the job's speed.
``--steps`` is still the job's ``trainer.total_steps``. Each batch is dumped to
``trajectories.jsonl`` (for the attention pairs): a few MB a step at the GPU shape, inside the
step's wall time, as is the disk weight sync (with LoRA: the adapter only). On a GPU the trainer
recomputes activations in the backward pass (``trainer.activation_checkpointing``); that extra
forward is not counted in the MFU.
"""

from __future__ import annotations

import json
import pathlib
import random
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
WORKFLOW = "tools.bench_lora_job:run"
FIXED_WORKFLOW = "tools.bench_lora_job:FixedLengthEpisode"


async def run(item, client) -> float:
    """The job's workflow (``rollout.workflow``): one answer of a budget drawn uniformly from the
    row's ``[response_min, response_max]``; its reward uniform in [0, 1)."""
    budget = random.randint(item.row["response_min"], item.row["response_max"])
    await client.chat.completions.create(model="policy", messages=item.messages, max_tokens=budget)
    return random.random()


class FixedLengthEpisode:
    """The fixed-length job's workflow (an ``Env``: no ``openai`` needed): one answer of
    ``rollout.max_new_tokens``, its reward uniform in [0, 1). (A pass/fail ``reward.fn`` would not
    do: a group whose samples all scored the same would be skipped.)"""

    def reset(self, item, seed):
        return None  # the group's prompt

    def step(self, action):
        return None, random.random(), True


# Everything below runs in the benchmark's own process only (the workers import this module for ``run``).

PEAK_TFLOPS = 989.0  # H200 dense bf16, datasheet
STOP_WAIT_S = 45.0  # after --budget-s, the launcher's own stop of its children; then it is killed
# the GRPO shape of the job; on a CPU a smaller one, so that the check of the whole path takes a minute or two
GPU_JOB = {"groups": 32, "samples": 8, "prompt_len": (512, 1024), "response_len": (256, 1024)}
CPU_JOB = {"groups": 8, "samples": 4, "prompt_len": (96, 192), "response_len": (32, 128)}
ROLES = {"engine": "areal_async.embedded.server", "trainer": "areal_async.trainer.main"}


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(",")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise ValueError(f"{text!r}: give MIN,MAX with 1 <= MIN <= MAX")
    return lo, hi


def write_prompts(path: pathlib.Path, tokenizer, rows: int, prompt_len: tuple[int, int],
                  response_len: tuple[int, int], seed: int = 0) -> list[int]:
    """``rows`` JSONL rows of random-digit prompts, each exactly a length drawn from ``prompt_len``
    once the chat template is applied; returns the lengths.

    Raises:
        ValueError: the template alone is longer than the shortest length asked for.
    """
    rng = random.Random(seed)

    def length(text: str) -> int:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])

    overhead = length("0")
    if overhead > prompt_len[0]:
        raise ValueError(f"--prompt-len {prompt_len[0]}: the chat template alone is {overhead} tokens")
    lengths, lines = [], []
    for _ in range(rows):
        target = rng.randint(*prompt_len)
        digits = "".join(rng.choice("0123456789") for _ in range(target - overhead + 1))
        for _ in range(8):  # digits are one token each in the shapes' tokenizer: the first try fits
            if (n := length(digits)) == target:
                break
            digits = digits[: len(digits) - (n - target)] if n > target else digits + "7" * (target - n)
        else:
            raise ValueError(f"cannot make a prompt of exactly {target} tokens of digits with this tokenizer")
        lengths.append(target)
        lines.append(json.dumps({"prompt": digits, "answer": "0", "response_min": response_len[0],
                                 "response_max": response_len[1]}))
    path.write_text("\n".join(lines) + "\n")
    return lengths


def max_running(device_gib: float | None) -> int:
    """The engine's running requests on a GPU of ``device_gib`` (``None``: unknown): 128 from 120 GiB
    on (an H200's 141 GB), else 64 (at 8b, 18 GiB fewer KV rows than 128: engine and trainer then fit
    80 GB)."""
    return 128 if device_gib is None or device_gib >= 120 else 64


def device_gib() -> float | None:
    """GPU 0's total memory in GiB from ``nvidia-smi``; ``None`` without it."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, timeout=30).stdout.split()
    return float(out[0]) / 1024 if out else None


def job_config(args, work: pathlib.Path, model_dir: pathlib.Path, data: pathlib.Path) -> dict:
    """The job's config (the YAML the launcher is given); overrides go on top of it."""
    cuda = args.device.startswith("cuda")
    p_hi, (r_lo, r_hi) = args.prompt_len[1], args.response_len
    batch = args.groups * args.samples
    cfg = {
        "name": f"bench_lora_job_{args.shape}", "seed": 1, "mode": "throughput", "run_root": str(work / "runs"),
        "model": {"path": str(model_dir), "dtype": "bfloat16" if cuda else "float32"},
        "data": {"task": "file", "train_path": str(data), "test_path": str(data), "few_shot": 0,
                 "max_prompt_len": p_hi},
        "inference": {"backend": "embedded", "num_servers": 1, "device": "cuda:0" if cuda else "cpu",
                      # 8b: (128 + 1 + 8 prefix rows) × 2048 positions × 144 KiB = 38.5 GiB of KV
                      "max_running_requests": min(batch, args.max_running) if cuda else batch,
                      "max_seq_len": p_hi + r_hi},
        "rollout": {"num_workers": 1, "n_samples": args.samples, "max_new_tokens": r_hi, "temperature": 1.0,
                    "max_groups_in_flight": args.groups},
        "queue": {"batch_size": args.groups, "max_staleness": 1, "max_concurrent": 2 * args.groups},
        "trainer": {"nproc": 1, "total_steps": args.steps, "lr": 1e-6, "device": "cuda" if cuda else "cpu",
                    "dtype": "bfloat16" if cuda else "float32", "weight_sync": "disk", "checkpoint_every": 0,
                    # one group's tree (prompt ≤ 1024 + 8 responses ≤ 1024) fits one micro-batch
                    "max_tokens_per_mb": 16384 if cuda else 4096, "logit_chunk_tokens": 4096 if cuda else 1024,
                    # 8b without it: ~12 MiB of kept activations a token, ~70 GB for one group's tree
                    "activation_checkpointing": cuda},
        "eval": {"at_start": False, "at_end": False, "every_steps": 0, "max_new_tokens": r_hi},
        "logging": {"wandb_mode": "disabled", "dump_trajectories": True},
    }
    cfg["rollout"]["workflow"] = FIXED_WORKFLOW if r_lo == r_hi else WORKFLOW
    return cfg


class MemorySampler:
    """Peak device memory per role and of the whole device, from ``nvidia-smi`` every ``period_s``
    in a thread; nothing (``available`` False) without ``nvidia-smi``."""

    def __init__(self, period_s: float = 0.5):
        import shutil
        import threading

        self.period_s, self.available = period_s, shutil.which("nvidia-smi") is not None
        self.peak_mib = {role: 0.0 for role in ROLES} | {"device": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _query(self, what: str) -> list[list[str]]:
        import subprocess

        out = subprocess.run(["nvidia-smi", f"--query-{what}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                used = sum(float(row[0]) for row in self._query("gpu=memory.used"))
                self.peak_mib["device"] = max(self.peak_mib["device"], used)
                for pid, mib in self._query("compute-apps=pid,used_memory"):
                    role = self._role(int(pid))
                    if role:
                        self.peak_mib[role] = max(self.peak_mib[role], float(mib))
            except Exception:  # nvidia-smi failing once, a process gone between the two reads: try again
                continue

    @staticmethod
    def _role(pid: int) -> str | None:
        try:
            cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            return None
        return next((role for role, module in ROLES.items() if module in cmdline), None)

    def __enter__(self):
        if self.available:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.available:
            self._thread.join()


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def lora_of(run_dir: pathlib.Path) -> tuple[int, object]:
    """``(rank, target_modules)`` of ``trainer.lora`` in the run's resolved config; rank 0 if none."""
    import yaml

    path = run_dir / "config.yaml"
    cfg = yaml.safe_load(path.read_text()) if path.exists() else {}
    lora = ((cfg or {}).get("trainer") or {}).get("lora") or {}
    return int(lora.get("rank") or 0), lora.get("target_modules") or "all-linear"


def group_pairs(group: dict, shared: bool) -> float:
    """Attention pairs the trainer ran for one dumped group: its prompt once (``shared``) or per
    sequence; samples whose advantage is zero (rewards all equal, or a reward at the mean) left out.
    A sample's reward is its own plus its turns' (``algo.turn_rewards: sum``; an ``Env``'s are all
    turn rewards)."""
    from areal_async.flops import causal_pairs, shared_prompt_pairs

    rewards = [s["reward"] + sum(s.get("turn_rewards", ())) for s in group["samples"]]
    mean = sum(rewards) / len(rewards)
    kept = [len(s["output_ids"]) for s, r in zip(group["samples"], rewards) if r != mean and len(set(rewards)) > 1]
    p = len(group["prompt_ids"])
    if not kept:
        return 0.0
    return shared_prompt_pairs(p, kept) if shared else causal_pairs(p + r for r in kept)


def summarize(run_dir: pathlib.Path, skip: int, shape, samples: int, peak_tflops: float) -> dict:
    """The table's numbers (module docstring) from a run directory."""
    from areal_async.flops import lora_params, train_flops

    steps = sorted((r for r in read_jsonl(run_dir / "metrics.jsonl") if "perf/step_s" in r), key=lambda r: r["step"])
    if len(steps) <= skip:
        raise RuntimeError(f"{run_dir}: {len(steps)} steps logged, the table needs more than --skip-steps={skip}")
    timed = steps[skip:]
    start = steps[skip - 1]["time"] if skip > 0 else timed[0]["time"] - timed[0]["perf/step_s"]
    wall = timed[-1]["time"] - start
    rank, targets = lora_of(run_dir)
    adapter = lora_params(shape, rank, targets) if rank else 0
    resolved = (run_dir / "config.yaml").read_text() if (run_dir / "config.yaml").exists() else ""
    shared = "share_prefixes: false" not in resolved
    batches = {b["step"]: b for b in read_jsonl(run_dir / "trajectories.jsonl")}
    flops = 0.0
    for r in timed:
        pairs = sum(group_pairs(g, shared) for g in batches[r["step"]]["groups"])
        flops += train_flops(shape, int(r["train/forward_tokens"]), pairs, adapter)
    train_s = sum(r["perf/train_s"] for r in timed)
    generated = sum(r["rollout/response_len"] * samples * len(batches[r["step"]]["groups"]) for r in timed)
    return {"steps": len(timed), "wall_s": wall, "step_s": wall / len(timed), "train_s": train_s / len(timed),
            "gen_tok_s": generated / wall, "trained_tok_s": sum(r["train/tokens"] for r in timed) / wall,
            "trainer_tok_s": sum(r["train/tokens"] for r in timed) / train_s,
            "skipped_seqs": sum(r.get("train/skipped_seqs", 0) for r in timed),
            "lora_rank": rank, "lora_targets": targets, "adapter_params": adapter,
            "base_params": shape.matmul_params(), "flops": flops,
            "mfu": flops / train_s / (peak_tflops * 1e12)}


def main() -> None:
    import argparse
    import os
    import signal
    import subprocess
    import time

    began = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("overrides", nargs="*", help="section.key=value, forwarded to the launcher last")
    ap.add_argument("--shape", default="8b")
    ap.add_argument("--device", default="cuda", help="cuda | cpu")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-steps", type=int, default=1)
    ap.add_argument("--groups", type=int, default=0, help=f"default {GPU_JOB['groups']} (cpu: {CPU_JOB['groups']})")
    ap.add_argument("--samples", type=int, default=0, help=f"default {GPU_JOB['samples']} (cpu: {CPU_JOB['samples']})")
    ap.add_argument("--prompt-len", type=_span, default=None,
                    help="MIN,MAX tokens, chat template included; default 512,1024 (cpu: 96,192)")
    ap.add_argument("--response-len", type=_span, default=None,
                    help="MIN,MAX sampled tokens; default 256,1024 (cpu: 32,128)")
    ap.add_argument("--model-dir", default="", help="default: /tmp/qwen3-SHAPE-random")
    ap.add_argument("--work-dir", default="/tmp/bench_lora_job")
    ap.add_argument("--max-running", type=int, default=0,
                    help="the engine's running requests on a GPU; default by its memory: 128 from 120 GiB, else 64")
    ap.add_argument("--budget-s", type=float, default=500.0, help="stop the job this long after the script's start")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--json", default="")
    args = ap.parse_intermixed_args()
    for key, value in (CPU_JOB if args.device == "cpu" else GPU_JOB).items():
        setattr(args, key, getattr(args, key) or value)

    if args.response_len[0] < args.response_len[1]:
        import importlib.util

        if importlib.util.find_spec("openai") is None:  # the workflow's client; fail before minutes of set-up
            sys.exit("--response-len MIN,MAX with MIN < MAX runs the workflow `run`, whose client needs the openai "
                     "package: install it (pip install 'openai>=1.40'), or give a fixed --response-len N,N")
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "tools"))
    import yaml

    from areal_async.flops import DecoderShape
    from areal_async.model.source import load_tokenizer
    from qwen3_shapes import SHAPES, config as shape_config, write_model_dir

    if args.shape not in SHAPES:
        ap.error(f"--shape {args.shape}: choose among {' '.join(SHAPES)}")

    if args.device.startswith("cuda") and not args.max_running:
        gib = device_gib()
        args.max_running = max_running(gib)
        print(f"--max-running {args.max_running} (GPU memory {'unknown' if gib is None else f'{gib:.0f} GiB'})",
              flush=True)
    work = pathlib.Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = pathlib.Path(args.model_dir or f"/tmp/qwen3-{args.shape}-random")
    if not (model_dir / "config.json").exists():
        print(f"writing a random {args.shape} model to {model_dir}", flush=True)
        write_model_dir(args.shape, model_dir)
    print(f"model ready after {time.monotonic() - began:.0f} s", flush=True)
    data = work / "prompts.jsonl"
    lengths = write_prompts(data, load_tokenizer(model_dir), (args.steps + 2) * args.groups, args.prompt_len,
                            args.response_len)
    cfg = job_config(args, work, model_dir, data)
    config_path = work / "job.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    run_dir = pathlib.Path(cfg["run_root"]) / cfg["name"]
    cmd = [sys.executable, "-m", "launcher.local", str(config_path), *args.overrides, "--overwrite"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")}
    print(f"prompts: {len(lengths)} rows of {min(lengths)}-{max(lengths)} tokens in {data}\n+ {' '.join(cmd)}",
          flush=True)
    stopped = False
    with MemorySampler() as memory:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env)
        try:
            proc.wait(timeout=max(1.0, args.budget_s - (time.monotonic() - began)))
        except subprocess.TimeoutExpired:
            stopped = True
            print(f"[bench] --budget-s {args.budget_s:.0f} reached: stopping the job (SIGINT)", flush=True)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if proc.returncode and not stopped:
        sys.exit(f"the job failed (exit {proc.returncode}); its logs are in {run_dir}")

    shape = DecoderShape.from_hf(shape_config(args.shape))
    try:
        res = summarize(run_dir, args.skip_steps, shape, args.samples, args.peak_tflops)
    except RuntimeError as exc:
        sys.exit(f"no table: {exc}" + (f" (stopped at --budget-s {args.budget_s:.0f})" if stopped else ""))
    gib = {k: v / 1024 for k, v in memory.peak_mib.items()} if memory.available else {}
    res |= {"peak_gib": gib, "stopped_at_budget": stopped, "argv": sys.argv, "job": cfg}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(res, indent=1))

    lora = (f"LoRA r={res['lora_rank']} on {res['lora_targets']}: N_adapter {res['adapter_params'] / 1e6:.1f}M, "
            f"FLOPs 4·N_base + 6·N_adapter" if res["lora_rank"] else "full fine-tuning: FLOPs 6·N")
    print(f"\n{args.shape} (N_base {res['base_params'] / 1e6:,.1f}M matmul parameters), {args.device}, "
          f"{args.groups} groups x {args.samples} samples, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
          f"responses {args.response_len[0]}-{args.response_len[1]} tokens; {lora}; "
          f"overrides: {' '.join(args.overrides) or '(none)'}")
    print(f"steps {steps_label(res, args, stopped)}; MFU against {args.peak_tflops:.0f} TFLOP/s")
    mem = (f"{gib['engine']:>10.1f} {gib['trainer']:>11.1f} {gib['device']:>10.1f}" if gib
           else f"{'-':>10} {'-':>11} {'-':>10}")
    mfu = f"{res['mfu']:>6.1%}" if args.device.startswith("cuda") else f"{'-':>6}"
    print(f"{'steps':>5} {'s/step':>7} {'train s':>8} {'gen tok/s':>10} {'trained tok/s':>14} {'trainer tok/s':>14} "
          f"{'skipped':>8} {'engine GiB':>10} {'trainer GiB':>11} {'device GiB':>10} {'MFU':>6}")
    print(f"{res['steps']:>5} {res['step_s']:>7.2f} {res['train_s']:>8.2f} {res['gen_tok_s']:>10.0f} "
          f"{res['trained_tok_s']:>14.0f} {res['trainer_tok_s']:>14.0f} {res['skipped_seqs']:>8.0f} {mem} {mfu}")


def steps_label(res: dict, args, stopped: bool) -> str:
    first = args.skip_steps + 1
    end = "stopped at --budget-s" if stopped else f"of {args.steps}"
    return f"{first}-{first + res['steps'] - 1} timed ({end}; the first {args.skip_steps} left out)"


if __name__ == "__main__":
    main()
