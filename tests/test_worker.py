"""The generation worker and the evaluator against fake SGLang-shaped servers over real HTTP.

Two aiohttp apps on two ports answer ``/generate`` with SGLang's JSON shape (recorded below);
the replay queue runs as its TCP service; the inference client is the real one. The fake answers
a correct ``\\boxed{4}`` for even sampling seeds and a wrong answer for odd ones (greedy
requests: by prompt-length parity), and reports its ``weight_version``.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiohttp import web

from areal_async.config import DebugConfig, QueueConfig, RewardConfig, RolloutConfig
from areal_async.data.prompts import PromptSet
from areal_async.inference.client import InferenceClient, LogprobAlignmentError, ServerError
from areal_async.queue.client import QueueClient
from areal_async.queue.core import ReplayQueue
from areal_async.queue.server import serve
from areal_async.reward.pool import RewardPool
from areal_async.rollout.eval import evaluate
from areal_async.rollout.worker import GenerationWorker
from areal_async.types import sample_seed
from tests.support.loop import settle

SEED = 11
N_SAMPLES = 3

# A /generate response as SGLang returns it (with return_logprob), shortened.
RECORDED_RESPONSE = {
    "text": " 4",
    "output_ids": [17, 2],
    "meta_info": {
        "id": "g0-s0", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 30,
        "completion_tokens": 2, "cached_tokens": 0, "weight_version": "0",
        "output_token_logprobs": [[-0.25, 17, None], [-0.5, 2, None]],
    },
}


class FourTask:
    """Questions of varied length whose answer is always 4."""

    name = "four"
    reward_fn = "math"

    def __len__(self):
        return 9

    def messages(self, i):
        return [{"role": "user", "content": "What is 2+2?" + " 1" * i}]

    def gold(self, i):
        return "4"


class FakeSGLang:
    """The /generate and /health endpoints of N SGLang servers sharing one recorder."""

    def __init__(self, tok, gate_at: int | None = None):
        eos = tok.eos_token_id
        self.right = tok("so the answer is \\boxed{4}", add_special_tokens=False)["input_ids"] + [eos]
        self.wrong = tok("no idea", add_special_tokens=False)["input_ids"] + [eos]
        self.version = 0
        self.requests: list[tuple[int, dict]] = []
        self.in_flight = 0
        self.fail_rid: str | None = None
        self.shift_rid: str | None = None  # its log-prob entries name the previous token's id
        # With gate_at = k, requests are held until k are in flight at once (then all pass).
        self.gate = asyncio.Event()
        self.gate_reached = asyncio.Event()
        self.gate_at = gate_at
        if gate_at is None:
            self.gate.set()

    def app(self, index: int) -> web.Application:
        async def generate(request: web.Request) -> web.Response:
            body = await request.json()
            self.requests.append((index, body))
            if body["rid"] == self.fail_rid:
                return web.json_response({"error": "injected"}, status=500)
            self.in_flight += 1
            if self.gate_at is not None and self.in_flight >= self.gate_at:
                self.gate_reached.set()
            await self.gate.wait()
            self.in_flight -= 1
            sp = body["sampling_params"]
            if sp["temperature"] == 0:
                ok = len(body["input_ids"]) % 2 == 0
            else:
                ok = sp["sampling_seed"] % 2 == 0
            ids = (self.right if ok else self.wrong)[: sp["max_new_tokens"]]
            meta = {**RECORDED_RESPONSE["meta_info"], "id": body["rid"],
                    "completion_tokens": len(ids), "prompt_tokens": len(body["input_ids"]),
                    "weight_version": str(self.version),
                    "output_token_logprobs": [[-0.125 * (k + 1), t, None]
                                              for k, t in enumerate(ids)]}
            if body["rid"] == self.shift_rid:
                meta["output_token_logprobs"] = [[-0.5, body["input_ids"][-1], None]] + [
                    [-0.125 * (k + 1), t, None] for k, t in enumerate(ids[:-1])]
            return web.json_response({"text": "", "output_ids": ids, "meta_info": meta})

        async def health(request: web.Request) -> web.Response:
            return web.Response(text="ok")

        app = web.Application()
        app.router.add_post("/generate", generate)
        app.router.add_get("/health", health)
        return app


async def start_fakes(fake: FakeSGLang, n: int):
    runners, urls = [], []
    for i in range(n):
        runner = web.AppRunner(fake.app(i))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        runners.append(runner)
    return runners, urls


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def rewards():
    with RewardPool(RewardConfig(num_procs=1, timeout_s=30.0)) as pool:
        yield pool


def test_worker_streams_scored_versioned_groups(tokenizer, rewards):
    prompts = PromptSet(FourTask(), tokenizer, max_prompt_len=256, seed=SEED)
    rollout = RolloutConfig(n_samples=N_SAMPLES, max_new_tokens=32, max_groups_in_flight=2,
                            temperature=1.0)

    async def body():
        fake = FakeSGLang(tokenizer, gate_at=2 * N_SAMPLES)
        runners, urls = await start_fakes(fake, 2)
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=1, max_concurrent=8),
                            "deterministic")
        _, qserver = await serve(queue, "127.0.0.1", 0)
        port = qserver.sockets[0].getsockname()[1]
        async with InferenceClient(urls, timeout_s=30) as client, \
                await QueueClient.connect("127.0.0.1", port, 5) as wq, \
                await QueueClient.connect("127.0.0.1", port, 5) as trainer:
            worker = GenerationWorker(0, wq, client, prompts, rewards, rollout, SEED,
                                      DebugConfig(jitter_ms=2.0, jitter_seed=1))
            run = asyncio.create_task(worker.run())
            # Two groups of three samples are in flight at once, and no third group starts.
            await fake.gate_reached.wait()
            await settle()
            assert fake.in_flight == 2 * N_SAMPLES and (await queue.stats()).running == 2
            fake.gate.set()

            batch0 = await trainer.get_batch(0)
            await trainer.wait_drained(0)
            fake.version = 1
            await trainer.set_version(1)
            batch1 = await trainer.get_batch(1)
            batch2 = await trainer.get_batch(2)
            await trainer.close()
            await run  # ends cleanly once the queue is closed
        qserver.close()
        for r in runners:
            await r.cleanup()
        return fake, batch0, batch1, batch2

    fake, *batches = asyncio.run(asyncio.wait_for(body(), timeout=120))
    assert [[t.group_id for t in b] for b in batches] == [[0, 1], [2, 3], [4, 5]]
    for b, version in zip(batches, (0, 0, 1)):  # v(g) = max(0, g // 2 - 1)
        for traj in b:
            g = traj.group_id
            item = prompts.for_group(g)
            assert traj.prompt_ids.tolist() == item.prompt_ids
            assert traj.data_index == item.data_index
            assert [s.index for s in traj.samples] == list(range(N_SAMPLES))
            for s in traj.samples:
                assert s.seed == sample_seed(SEED, g, s.index)
                ok = s.seed % 2 == 0
                ids = fake.right if ok else fake.wrong
                assert s.output_ids.tolist() == ids
                assert s.behav_logprobs.tolist() == [-0.125 * (k + 1) for k in range(len(ids))]
                assert s.versions.tolist() == [version] * len(ids)
                assert (s.correct, s.reward, s.reward_error) == (ok, 5.0 if ok else -5.0, False)
                assert s.finish_reason == "stop"
    for server, req in fake.requests:
        g, i = (int(x) for x in req["rid"][1:].split("-s"))
        assert server == (g * N_SAMPLES + i) % 2
        sp = req["sampling_params"]
        assert sp["sampling_seed"] == sample_seed(SEED, g, i)
        assert sp["max_new_tokens"] == 32 and sp["stop_token_ids"] == [tokenizer.eos_token_id]
        assert req["input_ids"] == prompts.for_group(g).prompt_ids and req["return_logprob"]


def test_worker_jitter_is_seeded_by_the_jitter_seed_and_the_worker_id(tokenizer, rewards):
    # The delays before each request are numpy's uniform draws in [0, jitter_ms) from the
    # generator seeded with the words [jitter_seed, worker_id]: reproducible per worker, distinct
    # between workers of one run.
    prompts = PromptSet(FourTask(), tokenizer, max_prompt_len=256, seed=SEED)
    rollout = RolloutConfig(n_samples=N_SAMPLES, max_new_tokens=32)

    def delays_s(worker_id: int, jitter_seed: int) -> list[float]:
        worker = GenerationWorker(worker_id, None, None, prompts, rewards, rollout, SEED,
                                  DebugConfig(jitter_ms=5.0, jitter_seed=jitter_seed))
        return [worker._jitter.draw_s() for _ in range(4)]

    for worker_id, jitter_seed in ((0, 7), (3, 7), (0, 8)):
        expected = np.random.default_rng([jitter_seed, worker_id]).uniform(0.0, 0.005, 4).tolist()
        assert delays_s(worker_id, jitter_seed) == expected
    assert delays_s(0, 7) != delays_s(3, 7) and delays_s(0, 7) != delays_s(0, 8)


@pytest.mark.parametrize("fault,error,match", [
    ("fail_rid", ServerError, "HTTP 500"),
    # log-probs shifted by one token against output_ids: the group is not trained on them, the
    # job stops naming the sample
    ("shift_rid", LogprobAlignmentError, "rid 'g1-s1': output_token_logprobs do not match "
                                         "output_ids at output position 0"),
])
def test_worker_fails_loudly(tokenizer, rewards, fault, error, match):
    prompts = PromptSet(FourTask(), tokenizer, max_prompt_len=256, seed=SEED)
    rollout = RolloutConfig(n_samples=2, max_new_tokens=8, max_groups_in_flight=4)
    submitted: list[int] = []

    async def body():
        fake = FakeSGLang(tokenizer)
        setattr(fake, fault, "g1-s1")
        runners, urls = await start_fakes(fake, 1)
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=0, max_concurrent=8),
                            "deterministic")
        try:
            async with InferenceClient(urls, timeout_s=30) as client:
                worker = GenerationWorker(0, queue, client, prompts, rewards, rollout, SEED)
                submit = queue.submit
                queue.submit = lambda traj: (submitted.append(traj.group_id), submit(traj))[1]
                await worker.run()
        finally:
            for r in runners:
                await r.cleanup()

    with pytest.raises(ExceptionGroup) as info:
        asyncio.run(asyncio.wait_for(body(), timeout=120))
    assert info.group_contains(error, match=match, depth=None)
    assert 1 not in submitted


def test_evaluate_greedy_pass_at_1(tokenizer, rewards):
    prompts = PromptSet(FourTask(), tokenizer, max_prompt_len=256, seed=SEED)

    async def body():
        fake = FakeSGLang(tokenizer)
        runners, urls = await start_fakes(fake, 2)
        async with InferenceClient(urls, timeout_s=30) as client:
            done = []
            metrics = await evaluate(client, prompts, rewards, num_prompts=5, max_new_tokens=64, version=0,
                                     on_done=lambda: done.append(1))
            assert len(done) == 5
        for r in runners:
            await r.cleanup()
        return fake, metrics

    fake, metrics = asyncio.run(asyncio.wait_for(body(), timeout=120))
    # The fake answers right exactly for even prompt lengths.
    even = [len(prompts.at(j).prompt_ids) % 2 == 0 for j in range(5)]
    assert 0 < sum(even) < 5, "pick prompts so that the expected pass@1 is not 0 or 1"
    lengths = [len(fake.right if e else fake.wrong) for e in even]
    assert metrics == {"eval/pass@1": sum(even) / 5, "eval/response_len": sum(lengths) / 5,
                       "eval/boxed_ratio": sum(even) / 5, "eval/num_prompts": 5.0, "eval/version": 0.0}
    assert sorted(req["rid"] for _, req in fake.requests) == [f"eval-{j}" for j in range(5)]
    assert all(req["sampling_params"]["temperature"] == 0.0 for _, req in fake.requests)
    assert all(server == int(req["rid"][5:]) % 2 for server, req in fake.requests)


def test_an_evaluation_answered_by_another_weight_version_raises(tokenizer, rewards):
    # Two servers, one still at version 0 while the evaluation is of version 1 (a weight update
    # that reached only part of the servers, or landed mid-evaluation): the result is refused.
    from areal_async.rollout.eval import MixedVersionError

    prompts = PromptSet(FourTask(), tokenizer, max_prompt_len=256, seed=SEED)

    async def body():
        fakes = [FakeSGLang(tokenizer), FakeSGLang(tokenizer)]
        fakes[0].version = 1
        runners, urls = [], []
        for fake in fakes:
            rs, us = await start_fakes(fake, 1)
            runners += rs
            urls += us
        try:
            async with InferenceClient(urls, timeout_s=30) as client:
                await evaluate(client, prompts, rewards, num_prompts=4, max_new_tokens=64, version=1)
        finally:
            for r in runners:
                await r.cleanup()

    with pytest.raises(MixedVersionError, match=r"version 1 got tokens of weight versions \[0, 1\]"):
        asyncio.run(asyncio.wait_for(body(), timeout=120))


def test_worker_cli_exit_codes(tiny_model_dir, tokenizer, tmp_path):
    """``python -m areal_async.rollout.worker``: exit 0 once the queue closes; non-zero with the
    traceback when a server fails."""
    import sys

    import yaml

    async def run_cli(fail_rid: str | None) -> tuple[int, str, list]:
        fake = FakeSGLang(tokenizer)
        fake.fail_rid = fail_rid
        runners, urls = await start_fakes(fake, 1)
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=0, max_concurrent=4),
                            "deterministic")
        _, qserver = await serve(queue, "127.0.0.1", 0)
        cfg = {
            "seed": SEED, "mode": "deterministic", "model": {"path": str(tiny_model_dir)},
            "data": {"max_prompt_len": 400},
            "inference": {"base_port": int(urls[0].rsplit(":", 1)[1]), "num_servers": 1,
                          "max_seq_len": 512, "startup_timeout_s": 30},
            "rollout": {"n_samples": 2, "max_new_tokens": 16}, "eval": {"max_new_tokens": 16},
            "queue": {"port": qserver.sockets[0].getsockname()[1], "batch_size": 2,
                      "max_staleness": 0},
        }
        path = tmp_path / f"config-{fail_rid}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "areal_async.rollout.worker", "--config", str(path),
            "--worker-id", "0", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        batch = []
        if fail_rid is None:
            batch = await queue.get_batch(0)
            await queue.close()
        out, err = await proc.communicate()
        qserver.close()
        for r in runners:
            await r.cleanup()
        return proc.returncode, out.decode() + err.decode(), batch

    async def both():  # side by side: each has its own fake server, queue and config
        return await asyncio.gather(run_cli(None), run_cli("g1-s0"))

    (rc, log, batch), (rc_failed, log_failed, _) = asyncio.run(asyncio.wait_for(both(), timeout=200))
    assert rc == 0, log
    assert [t.group_id for t in batch] == [0, 1] and "queue closed: " in log
    assert "prompts kept" in log
    assert rc_failed != 0 and "ServerError" in log_failed and "HTTP 500" in log_failed, log_failed


def test_a_file_tasks_rows_reach_a_keyword_reward_from_the_worker_and_the_evaluation(tokenizer, tmp_path):
    # Rows of data.task=file with pass-through fields; reward.fn takes (response, answer, messages,
    # item) and records what it got. The fake answers right ("\boxed{4}") for even seeds; the
    # reward is 1 when the row's `target` is in the response, so odd rows want the wrong answer.
    import json

    from areal_async.config import DataConfig
    from areal_async.data import load_task

    calls = tmp_path / "calls.jsonl"
    rows = [{"prompt": "What is 2+2?" + " 1" * k, "answer": "4", "k": k, "record_to": str(calls),
             "target": "boxed{4}" if k % 2 == 0 else "no idea"} for k in range(4)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_task(DataConfig(task="file", train_path=str(tmp_path / "t.jsonl")), "train")
    prompts = PromptSet(task, tokenizer, max_prompt_len=256, seed=SEED)
    rollout = RolloutConfig(n_samples=2, max_new_tokens=32, max_groups_in_flight=2)

    async def body(rewards):
        fake = FakeSGLang(tokenizer)
        runners, urls = await start_fakes(fake, 1)
        queue = ReplayQueue(QueueConfig(batch_size=2, max_staleness=0, max_concurrent=8), "deterministic")
        async with InferenceClient(urls, timeout_s=30) as client:
            worker = GenerationWorker(0, queue, client, prompts, rewards, rollout, SEED)
            run = asyncio.create_task(worker.run())
            batch = await queue.get_batch(0)
            await queue.close()
            await run
            metrics = await evaluate(client, prompts, rewards, num_prompts=4, max_new_tokens=32, version=0)
        for r in runners:
            await r.cleanup()
        return fake, batch, metrics

    with RewardPool(RewardConfig(fn="tests.support.reward_forms:record", num_procs=1, timeout_s=30.0)) as rewards:
        fake, batch, metrics = asyncio.run(asyncio.wait_for(body(rewards), timeout=120))
    got = [json.loads(x) for x in calls.read_text().splitlines()]
    assert len(got) == 2 * 2 + 4  # two groups of two samples, then four evaluation prompts
    right, wrong = (tokenizer.decode(ids, skip_special_tokens=True) for ids in (fake.right, fake.wrong))
    for call in got:
        k = call["item"]["k"]
        assert call["item"] == rows[k] and call["answer"] == "4"
        assert call["messages"] == task.messages(k) + [{"role": "assistant", "content": call["response"]}]
        assert call["response"] in (right, wrong)
    for traj in batch:
        k = traj.data_index
        for s in traj.samples:
            said_right = s.seed % 2 == 0
            assert s.correct == (said_right == (k % 2 == 0)), (k, s.seed)
    even = [len(prompts.at(j).prompt_ids) % 2 == 0 for j in range(4)]  # greedy: right on even lengths
    assert metrics["eval/pass@1"] == sum(e == (j % 2 == 0) for j, e in enumerate(even)) / 4
