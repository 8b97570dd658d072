"""Progress display (areal_async/progress.py) and how the launcher passes it on (supervisor)."""

from __future__ import annotations

import asyncio
import io
import sys

import pytest

from areal_async.progress import Progress, progress_mode


def test_plain_lines_at_most_every_interval_and_none_for_a_short_phase(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("areal_async.progress.time.monotonic", lambda: clock[0])
    out = io.StringIO()
    with Progress("eval of version 0", 60, "prompts", mode="lines", interval_s=30, file=out) as p:
        p.update(5)  # 0 s in: too soon
        clock[0] += 31
        p.update(5)  # 31 s: a line
        clock[0] += 10
        p.update()  # 10 s after the last line: none
        clock[0] += 25
        p.tick()  # 35 s after it, no new prompt: the clock alone
    assert out.getvalue().splitlines() == ["[trainer] eval of version 0: 10/60 prompts (31 s)",
                                           "[trainer] eval of version 0: 11/60 prompts (66 s)"]
    short = io.StringIO()
    with Progress("step 1/30: training", None, "micro-batches trained", mode="lines", file=short) as p:
        p.update(3)
    assert short.getvalue() == ""


def test_follow_polls_a_count_while_waiting():
    out = io.StringIO()

    async def body():
        counts = iter([1, 3, 3, 8])
        with Progress("step 0/2: rollouts", 8, "groups", mode="lines", interval_s=0, file=out) as p:
            task = asyncio.create_task(p.follow(lambda: asyncio.sleep(0, next(counts)), every_s=0.001))
            while p.n < 8:
                await asyncio.sleep(0.001)
            task.cancel()

    asyncio.run(asyncio.wait_for(body(), 10))
    counts = [line.split(": ")[2].split()[0] for line in out.getvalue().splitlines()]
    assert counts[0] == "1/8" and counts[-1] == "8/8" and "3/8" in counts


def test_a_bar_draws_in_place_and_clears_itself():
    out = io.StringIO()
    with Progress("eval of version 0", 4, "prompts", mode="bar", delay_s=0, file=out) as p:
        p.update(4)  # within tqdm's 0.5 s between redraws: not drawn yet ...
        p.tick()  # ... the once-a-second tick redraws it
    text = out.getvalue()
    assert "\r" in text and "4/4" in text and "\n" not in text  # leave=False: nothing stays


def test_the_mode_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("AREAL_ASYNC_PROGRESS", "off")
    assert progress_mode() == "off"
    monkeypatch.setenv("AREAL_ASYNC_PROGRESS", "fancy")
    with pytest.raises(ValueError, match="AREAL_ASYNC_PROGRESS='fancy'.*'bar', 'lines', 'off'"):
        progress_mode()
    monkeypatch.delenv("AREAL_ASYNC_PROGRESS")
    assert progress_mode() == ("bar" if sys.stdout.isatty() else "lines")


def test_the_supervisor_echoes_bars_as_they_come_and_logs_finished_lines(tmp_path, capfd):
    from launcher.supervisor import Supervisor

    sup = Supervisor(tmp_path / "logs")
    script = ("import sys, time\n"
              "w = sys.stdout.write\n"
              "w('start\\n'); w('\\rbar 1/2'); sys.stdout.flush(); time.sleep(0.2)\n"
              "w('\\rbar 2/2'); w('\\r       \\r'); w('step 0 | 1.0 s\\n'); w('\\r\\u2588 kept\\n'); w('\\n')\n")
    child = sup.start("trainer", [sys.executable, "-c", script], echo=True, expect_exit=True)
    assert sup.wait_for(child, poll_s=0.05) == 0
    sup.stop_all()
    echoed = capfd.readouterr().out
    assert "start\n\rbar 1/2\rbar 2/2\r       \rstep 0 | 1.0 s\n\r\u2588 kept\n\n" in echoed  # byte for byte
    log = (tmp_path / "logs" / "trainer.log").read_text().partition("\nstart\n")[2].splitlines()
    log = ["start", *log]  # after the command line (the script spans lines)
    assert log == ["start", "step 0 | 1.0 s", "\u2588 kept", ""]
    assert list(child.tail) == log


def test_a_bar_left_unfinished_by_a_stopped_child_stays_out_of_the_log(tmp_path, capfd):
    from launcher.supervisor import Supervisor

    sup = Supervisor(tmp_path / "logs")
    script = "import sys\nsys.stdout.write('step 3 | 1.0 s\\n\\rstep 4/60: training: 1/3 mb'); sys.stdout.flush()\n"
    child = sup.start("trainer", [sys.executable, "-c", script], echo=True, expect_exit=True)
    assert sup.wait_for(child, poll_s=0.05) == 0
    sup.stop_all()
    assert "\rstep 4/60: training: 1/3 mb" in capfd.readouterr().out  # the terminal saw it
    log = (tmp_path / "logs" / "trainer.log").read_text()
    assert log.splitlines()[-1] == "step 3 | 1.0 s"  # the command line above holds the script's text
    assert list(child.tail)[-1] == "step 3 | 1.0 s"


def test_micro_batches_trained_are_counted_of_the_plans_total(tiny_model_dir):
    # train_step reports each micro-batch's backward as (done, total) of this rank's plan; the
    # no-grad proximal passes of ppo_minibatches=2 are not counted
    import torch
    from transformers import AutoModelForCausalLM

    from areal_async.config import AlgoConfig, TrainerConfig
    from areal_async.trainer.attention import use_packed_attention
    from areal_async.trainer.packed_policy import PackedPolicy
    from areal_async.trainer.step import train_step
    from tests.support.batches import make_trajectories

    torch.set_num_threads(1)
    lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    use_packed_attention(lm)
    policy = PackedPolicy(lm)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    seen = {}
    for n_mini, budget in ((1, 24), (2, 24), (1, 4096)):
        calls = []
        forwards = []
        hook = policy.register_forward_hook(lambda *a: forwards.append(torch.is_grad_enabled()))
        train_step(policy, optimizer, make_trajectories(lm.config.vocab_size), AlgoConfig(ppo_minibatches=n_mini),
                   TrainerConfig(max_tokens_per_mb=budget), 1.0, torch.device("cpu"),
                   on_micro_batch=lambda done, total: calls.append((done, total)))
        hook.remove()
        total = forwards.count(True)
        assert calls == [(k, total) for k in range(1, total + 1)], (n_mini, budget)
        seen[(n_mini, budget)] = (total, forwards.count(False))
    assert seen[(1, 24)][0] > seen[(1, 4096)][0] == 1  # a small budget makes several micro-batches
    assert seen[(2, 24)][1] > 0  # the proximal passes ran and were not counted


def test_a_bar_names_its_unit_as_a_word_and_learns_its_total():
    out = io.StringIO()
    with Progress("step 1/30: training", None, "micro-batches trained", mode="bar", delay_s=0, file=out) as p:
        p.update()
        p.tick()
        p.set_total(5)
        p.update(2)
        p.tick()
    text = out.getvalue()
    assert "1 micro-batches trained" in text and "3/5 micro-batches trained" in text
    assert "1micro-batches" not in text
