"""``tools/bench_lora_job.py`` on CPU: its prompts, and its table's numbers from a hand-made run
directory (values derived by hand in comments); the whole job at the tiny shape is ``slow``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from areal_async.flops import DecoderShape
from tests.support import REPO
from tests.support.tools import load_tool

TINY = DecoderShape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=1024, tied=True)


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_lora_job")


def test_prompts_have_the_lengths_drawn(bench, tmp_path):
    sys.path.insert(0, str(REPO / "tools"))
    from qwen3_shapes import _tokenizer

    tok = _tokenizer()
    path = tmp_path / "p.jsonl"
    lengths = bench.write_prompts(path, tok, 12, (40, 90), (5, 7))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 12 and all(40 <= n <= 90 for n in lengths) and len(set(lengths)) > 1
    for row, n in zip(rows, lengths):
        text = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                       add_generation_prompt=True)
        assert len(tok(text, add_special_tokens=False)["input_ids"]) == n  # as data/prompts.py counts it
        assert (row["response_min"], row["response_max"], row["answer"]) == (5, 7, "0")
    with pytest.raises(ValueError, match="chat template alone"):
        bench.write_prompts(path, tok, 1, (2, 3), (5, 7))


def test_the_engine_holds_fewer_requests_on_an_80_gb_gpu(bench, tmp_path):
    # 128 running requests of 2,048 positions at 8b (38.5 GiB of KV) beside the LoRA trainer ran out
    # of memory on an H100's 79.2 GiB; the H200 has ~140 GiB
    assert [bench.max_running(g) for g in (139.8, 120.0, 79.2, None)] == [128, 128, 64, 128]
    args = SimpleNamespace(shape="8b", device="cuda", prompt_len=(512, 1024), response_len=(256, 1024), groups=32,
                           samples=8, steps=2, max_running=64)
    cfg = bench.job_config(args, tmp_path, tmp_path / "model", tmp_path / "p.jsonl")
    assert cfg["inference"]["max_running_requests"] == 64 and cfg["inference"]["max_seq_len"] == 2048


def _run_dir(tmp_path, lora: dict | None, rewards=(0.2, 0.7)):
    run = tmp_path / "run"
    run.mkdir()
    # step 0 ends at t = 6 s, step 1 at t = 10 s: with --skip-steps 1, step 1 alone is timed (4 s)
    metrics = [{"step": 0, "time": 6.0, "perf/step_s": 6.0, "perf/train_s": 5.0, "train/forward_tokens": 99,
                "train/tokens": 99, "rollout/response_len": 9.0},
               {"step": 1, "time": 10.0, "perf/step_s": 4.0, "perf/train_s": 2.0, "train/forward_tokens": 10,
                "train/tokens": 14, "rollout/response_len": 3.0, "train/skipped_seqs": 0.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    group = {"prompt_ids": [1] * 4, "samples": [{"output_ids": [5] * 2, "reward": rewards[0]},
                                                {"output_ids": [5] * 4, "reward": rewards[1]}]}
    (run / "trajectories.jsonl").write_text("".join(json.dumps({"step": s, "groups": [group]}) + "\n" for s in (0, 1)))
    lines = ["trainer:", "  lr: 1.0e-06"]
    if lora:
        lines += ["  lora:", f"    rank: {lora['rank']}", f"    target_modules: {json.dumps(lora['target_modules'])}"]
    (run / "config.yaml").write_text("\n".join(lines) + "\n")
    return run


def test_summary_full_fine_tune_by_hand(bench, tmp_path):
    res = bench.summarize(_run_dir(tmp_path, None), 1, TINY, samples=2, peak_tflops=1e-6)  # peak 1e6 FLOP/s
    # prompt 4 shared by responses 2 and 4: pairs 4²/2 + (2·4 + 2²/2) + (4·4 + 4²/2) = 8 + 10 + 24 = 42;
    # FLOPs 6·139648·10 + 12·2·4·16·42 = 8378880 + 64512 = 8443392, over 2 s at 1e6 FLOP/s
    assert res["flops"] == 8_443_392
    assert res["mfu"] == pytest.approx(8_443_392 / 2 / 1e6)
    assert (res["steps"], res["wall_s"], res["step_s"], res["train_s"]) == (1, 4.0, 4.0, 2.0)
    # generated: 3 tokens a sample × 2 samples × 1 group over 4 s; trained: 14 tokens over 4 s, over 2 s
    assert (res["gen_tok_s"], res["trained_tok_s"], res["trainer_tok_s"]) == (1.5, 3.5, 7.0)
    assert (res["lora_rank"], res["adapter_params"], res["skipped_seqs"]) == (0, 0, 0)


def test_summary_lora_by_hand(bench, tmp_path):
    run = _run_dir(tmp_path, {"rank": 8, "target_modules": ["q_proj", "v_proj"]})
    res = bench.summarize(run, 1, TINY, samples=2, peak_tflops=1e-6)
    # N_adapter = 2 layers · 8 · ((64 + 64) + (64 + 32)) = 3584; (4·139648 + 6·3584)·10 + 64512
    assert (res["lora_rank"], res["adapter_params"]) == (8, 3584)
    assert res["flops"] == 5_865_472


def test_a_group_of_equal_rewards_costs_no_attention(bench, tmp_path):
    group = {"prompt_ids": [1] * 4, "samples": [{"output_ids": [5] * 2, "reward": 1.0},
                                                {"output_ids": [5] * 4, "reward": 1.0}]}
    assert bench.group_pairs(group, shared=True) == 0.0
    group["samples"][1]["reward"] = 0.0
    assert bench.group_pairs(group, shared=True) == 42.0
    assert bench.group_pairs(group, shared=False) == 18.0 + 32.0  # (4 + 2)²/2 + (4 + 4)²/2
    # an Env's episodes: reward 0, the turn rewards carry it (summed)
    for sample, turn in zip(group["samples"], (0.3, 0.3)):
        sample.update(reward=0.0, turn_rewards=[turn])
    assert bench.group_pairs(group, shared=True) == 0.0
    group["samples"][0]["turn_rewards"] = [0.1, 0.4]
    assert bench.group_pairs(group, shared=True) == 42.0  # 0.1 + 0.4 vs 0.3: both advantages non-zero


@pytest.mark.slow
def test_whole_job_on_cpu(tmp_path):
    # ~40 s on 2 cores: the engine, the workflow's budgets, the trainer, the table
    out = subprocess.run([sys.executable, "tools/bench_lora_job.py", "--shape", "tiny", "--device", "cpu", "--steps",
                          "2", "--work-dir", str(tmp_path / "work"), "--model-dir", str(tmp_path / "model")],
                         cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    header, row = out.stdout.strip().splitlines()[-2:]
    assert header.split()[:3] == ["steps", "s/step", "train"] and row.split()[0] == "1"
    assert row.split()[6] == "0"  # no sequence skipped
