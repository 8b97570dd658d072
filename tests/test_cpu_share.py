"""Threads that follow who computes (areal_async/cpu_share.py, ``cpu_threads: adaptive``)."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest
import torch

from areal_async.config import load_config
from areal_async.cpu_share import PATH_ENV, SLOT_ENV, CpuShare, create_ledger, from_environment, refresh_around_layers
from areal_async.embedded.engine.sampling import SamplingParams
from areal_async.embedded.loading import load_engine
from launcher.placement import check_adaptive, place_job

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def ledger(tmp_path):
    return create_ledger(tmp_path / "cpu_share", 3)


def test_threads_are_the_cpus_divided_by_the_parties_computing(ledger):
    server, trainer = CpuShare(ledger, 0, cpus=4), CpuShare(ledger, 2, cpus=4)
    assert ledger.read_bytes() == b"\0\0\0"
    with trainer.working():
        assert torch.get_num_threads() == 4  # alone: 4 CPUs // 1
        server.busy()
        assert ledger.read_bytes() == b"\1\0\1"
        assert trainer.refresh() == 2 and torch.get_num_threads() == 2  # beside the server: 4 // 2
        server.idle()
        assert trainer.refresh() == 4
    assert ledger.read_bytes() == b"\0\0\0" and trainer.computing() == 0
    assert CpuShare(ledger, 1, cpus=1).refresh() == 1  # never below one thread


def test_a_failing_step_still_marks_the_party_idle(ledger):
    share = CpuShare(ledger, 1, cpus=2)
    with pytest.raises(RuntimeError, match="step failed"):
        with share.working():
            raise RuntimeError("step failed")
    assert ledger.read_bytes() == b"\0\0\0"


def test_a_slot_outside_the_ledger_is_refused(ledger):
    with pytest.raises(ValueError, match=rf"{SLOT_ENV}=3: the ledger .* has slots 0..2"):
        CpuShare(ledger, 3)


def test_the_environment_gives_a_rank_its_slot_after_the_servers(ledger):
    assert from_environment({}) is None
    share = from_environment({PATH_ENV: str(ledger), SLOT_ENV: "1"}, local_rank=1)
    assert share.slot == 2


def test_layers_refresh_before_their_forward_and_before_their_backward(ledger):
    # two layers: forward refreshes before each (2), backward before each layer's gradient (2);
    # the other party starts computing between forward and backward, so the backward runs at 1 thread
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    mine, other = CpuShare(ledger, 2, cpus=2), CpuShare(ledger, 0, cpus=2)
    seen: list[int] = []
    refresh = mine.refresh
    mine.refresh = lambda: seen.append(refresh()) or seen[-1]
    assert refresh_around_layers(mine, layers) == 2
    with mine.working():
        out = layers(torch.randn(3, 4, requires_grad=True)).sum()
        other.busy()
        out.backward()
    assert seen == [2, 2, 2, 1, 1]  # working() on entry, 2 forwards alone, 2 backwards beside the other


def test_the_engine_is_busy_while_it_steps_and_refreshes_on_its_forward_thread(ledger, tiny_model_dir):
    async def main():
        engine, _ = load_engine(str(tiny_model_dir), "float32", "cpu", 2, 64)
        share = CpuShare(ledger, 0, cpus=2)
        calls: list[tuple[str, bytes]] = []
        refresh = share.refresh

        def traced():
            calls.append((threading.current_thread().name, ledger.read_bytes()))
            return refresh()

        share.refresh = traced
        engine.cpu_share = share
        task = asyncio.create_task(engine.run())
        params = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        await engine.generate([5, 17, 42], params, "a")
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return calls

    calls = asyncio.run(main())
    assert len(calls) >= 3  # one refresh per step: a prefill and decodes
    assert all(name.startswith("forward") and seen[0] == 1 for name, seen in calls)
    assert ledger.read_bytes() == b"\0\0\0"  # idle once there was nothing to run


def test_placement_gives_servers_and_ranks_their_slots(tmp_path):
    cfg = load_config(None, ["cpu_threads=adaptive", "inference.num_servers=2", "trainer.nproc=2",
                             f"run_root={tmp_path}", "name=r"])
    placed = place_job(cfg, frozenset({0, 1}), 2, {})
    path = str((tmp_path / "r" / "cpu_share").resolve())
    wait = {"OMP_WAIT_POLICY": "PASSIVE"}  # threads sleep at barriers: counts may lag the ledger
    assert [dict(s.env) for s in placed.servers] == [{**wait, PATH_ENV: path, SLOT_ENV: "0"},
                                                     {**wait, PATH_ENV: path, SLOT_ENV: "1"}]
    assert (placed.trainer.env[PATH_ENV], placed.trainer.env[SLOT_ENV], placed.trainer.env["OMP_WAIT_POLICY"]) == \
        (path, "2", "PASSIVE")
    spin = place_job(cfg, frozenset({0, 1}), 2, {"OMP_WAIT_POLICY": "ACTIVE"})
    assert spin.servers[0].env["OMP_WAIT_POLICY"] == "ACTIVE"  # the launcher's own setting wins
    fixed = place_job(load_config(None, []), frozenset({0, 1}), 2, {})
    assert PATH_ENV not in fixed.trainer.env and dict(fixed.servers[0].env) == {}


@pytest.mark.parametrize("override, words", [
    ('trainer.cpus="1"', r"trainer.cpus='1' pin processes apart"),
    ("inference.threads=2", "inference.threads=2 fixes the servers' threads"),
])
def test_adaptive_threads_are_refused_beside_keys_that_contradict_them(override, words):
    with pytest.raises(ValueError, match=rf"^cpu_threads=adaptive: {words}"):
        check_adaptive(load_config(None, ["cpu_threads=adaptive", override]))


@pytest.mark.parametrize("override, words", [
    ("mode=deterministic", "mode=deterministic needs fixed thread counts"),
    ("inference.device=cuda:0", "inference.device='cuda:0'.*the work is on a GPU"),
    ("inference.backend=sglang", "inference.backend='sglang': only the embedded engine"),
])
def test_where_adaptive_threads_do_not_apply_the_threads_stay_fixed_with_a_warning(override, words, tmp_path):
    cfg = load_config(None, ["cpu_threads=adaptive", override, f"run_root={tmp_path}"])
    placed = place_job(cfg, frozenset({0, 1}), 2, {})
    assert len(placed.warnings) == 1
    assert re.match(rf"cpu_threads=adaptive does not apply \({words}.*\): the threads stay fixed$", placed.warnings[0])
    assert PATH_ENV not in placed.trainer.env and all(PATH_ENV not in s.env for s in placed.servers)
    assert placed.servers[0].threads == 1  # 2 CPUs // (1 server + 1 rank), as fixed
