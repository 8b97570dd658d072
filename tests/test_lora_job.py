"""A LoRA job end to end (launcher.local, tiny model): the adapter-only weight sync reaches the
engine, seen from the trainer: the engine's behaviour log-probs of tokens it generated at version v
equal the trainer's recomputation at v (``train/logprob_diff_*``), which they cannot if the servers
still generate with an older adapter while reporting version v."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO
from tests.support.jobs import TINY_JOB_CONFIG, tiny_job_overrides


@pytest.mark.parametrize("sync", ["distributed", pytest.param("disk", marks=pytest.mark.slow)])
def test_each_version_s_adapter_reaches_the_engine(tiny_model_dir, tmp_path, sync):
    # η = 0: every token of step k's batch was generated at version k, the trainer's version then.
    # lr 1e-2 with alpha/r = 4 moves the log-probs by ~1e-2 a step (measured), far above fp32 noise
    # between the engine's decode and the trainer's packed forward (< 1e-6 on this model).
    overrides = [*tiny_job_overrides(tiny_model_dir, steps=3), "trainer.lora.rank=4", "trainer.lora.alpha=16",
                 "trainer.lr=1e-2", "trainer.weight_decay=0", "queue.max_staleness=0",
                 f"trainer.weight_sync={sync}", f"run_root={tmp_path}", "name=lora"]
    proc = subprocess.run([sys.executable, "-m", "launcher.local", TINY_JOB_CONFIG, *overrides], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/logprob_diff_max" in r]
    assert len(steps) == 3
    assert all(r["train/logprob_diff_tokens"] > 0 for r in steps)
    assert max(r["train/logprob_diff_max"] for r in steps) < 1e-4, [r["train/logprob_diff_max"] for r in steps]
    assert len({round(r["train/loss"], 9) for r in steps}) > 1  # it trained
    if sync == "disk":
        assert sorted(p.name for p in (tmp_path / "lora" / "adapters").iterdir()) == ["v3"]  # the newest only
