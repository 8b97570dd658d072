"""Resume in deterministic mode: a run stopped after step 3 and resumed from its checkpoint ends
at step 6 with the same metrics, trajectories and weights as an unbroken 6-step run.

What makes it exact: the checkpoint holds the fp32 weights, the full AdamW state and the RNG
(``trainer/resume.py``) and the groups the queue had finished but not yet handed out (taken after
``wait_drained``, so they are exactly the groups of versions ≤ 3 not yet trained); the servers
restart with the checkpoint's weights as version 3 and the queue at version 3 with that buffer.
Data order and sampling seeds are functions of (run seed, group id) and need no state.
"""

import copy
import json

import pytest

from tests.support.jobs import fingerprint, run_job


@pytest.mark.slow
def test_resumed_run_matches_unbroken_run(tiny_model_dir, tmp_path):
    # a 3-step warm-up (lr/3, 2lr/3, lr, then lr: the same for 3 and 6 total steps): the resumed
    # steps' train/lr must be the unbroken run's (the scheduler's state is in the checkpoint), not a
    # warm-up restarted at lr/3
    schedule = ("trainer.warmup_steps=3",)
    unbroken = fingerprint(run_job(tiny_model_dir, tmp_path, "unbroken", "deterministic", 1, steps=6, extra=schedule))
    stopped = run_job(tiny_model_dir, tmp_path, "resumed", "deterministic", 2, steps=3, extra=schedule)
    for log in ("metrics.jsonl", "trajectories.jsonl"):  # as if it had run on past its checkpoint
        last = json.loads((stopped / log).read_text().splitlines()[-1])
        with (stopped / log).open("a") as f:
            f.write(json.dumps({**last, "step": 3}) + "\n" + json.dumps({**last, "step": 4}) + "\n")
    resumed = fingerprint(run_job(tiny_model_dir, tmp_path, "resumed", "deterministic", 3, steps=6, resume=True,
                                  extra=schedule))
    print(f"\nweights sha256: unbroken {unbroken['weights']} / resumed {resumed['weights']}")
    assert [r["step"] for r in resumed["metrics"]] == list(range(6))
    assert resumed["metrics"] == unbroken["metrics"]
    assert resumed["trajectories"] == unbroken["trajectories"]
    assert resumed["weights"] == unbroken["weights"]


def test_an_interrupted_checkpoint_write_keeps_the_previous_checkpoint(tmp_path):
    # The next checkpoint is written whole into a staging directory and swapped in only when
    # complete: stopping the job in the middle of the (1 GB, seconds-long) training-state write
    # leaves the previous checkpoint resumable.
    from areal_async.trainer.resume import publish_checkpoint, read_step, recover_checkpoint, staging_dir

    ckpt = tmp_path / "checkpoint"

    def write(step: int, complete: bool = True) -> None:
        staging = staging_dir(ckpt)
        staging.mkdir()
        (staging / "model.safetensors").write_bytes(b"weights of step %d" % step)
        (staging / "trainer_state.pt").write_bytes(b"partial" if not complete else b"state")
        if complete:
            (staging / "trainer_state.json").write_text(json.dumps({"step": step}))
            publish_checkpoint(ckpt)

    write(1)
    write(2, complete=False)  # interrupted: publish_checkpoint never ran
    assert read_step(ckpt) == 1
    assert (ckpt / "model.safetensors").read_bytes() == b"weights of step 1"
    recover_checkpoint(ckpt)  # what --resume does first: the half-written staging goes
    assert not staging_dir(ckpt).exists() and read_step(ckpt) == 1
    write(3)
    assert read_step(ckpt) == 3 and (ckpt / "model.safetensors").read_bytes() == b"weights of step 3"
    # interrupted between publish_checkpoint's two renames: the old one is put back
    ckpt.rename(ckpt.with_name("checkpoint.old"))
    recover_checkpoint(ckpt)
    assert read_step(ckpt) == 3


def test_a_checkpoint_is_written_into_its_staging_directory_and_swapped_in(tiny_model_dir, tmp_path, monkeypatch):
    # The weights go straight into checkpoint.partial, next to the training state; the only
    # renames are publish_checkpoint's swap (none of a directory of weights into the staging one).
    import pathlib

    import torch
    from transformers import AutoModelForCausalLM

    from areal_async.config import load_config
    from areal_async.trainer.packed_policy import PackedPolicy
    from areal_async.trainer.learner import save_checkpoint
    from areal_async.trainer.resume import read_step
    from areal_async.trainer.schedule import make_scheduler

    policy = PackedPolicy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    optimizer = torch.optim.AdamW(policy.parameters())
    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    scheduler = make_scheduler(optimizer, cfg.trainer)
    renames, rename = [], pathlib.Path.rename
    monkeypatch.setattr(pathlib.Path, "rename",
                        lambda self, target: renames.append((self.name, pathlib.Path(target).name)) or rename(self, target))
    for step in (1, 2):
        save_checkpoint(cfg, policy, optimizer, scheduler, tmp_path, step, [])
    assert renames == [("checkpoint.partial", "checkpoint"),
                       ("checkpoint", "checkpoint.old"), ("checkpoint.partial", "checkpoint")]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint"] and read_step(tmp_path / "checkpoint") == 2
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint", dtype=torch.float32).state_dict()
    assert all(torch.equal(saved[name], p) for name, p in policy.lm.state_dict().items())


def test_checkpoint_and_weight_update_files_get_the_users_file_mode(tiny_model_dir, tmp_path, umask_027):
    # safetensors writes each file through a temporary file, created 0600; what the trainer
    # publishes has the mode any file of the user gets (0666 & ~umask)
    import stat

    import torch
    from transformers import AutoModelForCausalLM

    from areal_async.config import load_config
    from areal_async.trainer.checkpoint import hf_metadata_files, write_hf_directory
    from areal_async.trainer.packed_policy import PackedPolicy
    from areal_async.trainer.learner import save_checkpoint

    from areal_async.trainer.schedule import make_scheduler

    policy = PackedPolicy(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32))
    cfg = load_config(None, [f"model.path={tiny_model_dir}"])
    optimizer = torch.optim.AdamW(policy.parameters())
    save_checkpoint(cfg, policy, optimizer, make_scheduler(optimizer, cfg.trainer), tmp_path, 1, [])
    tensors = {name: p.detach().clone() for name, p in policy.lm.named_parameters()}
    write_hf_directory(tmp_path / "v1", tensors, hf_metadata_files(tiny_model_dir, torch.float32))
    files = [*(tmp_path / "checkpoint").iterdir(), *(tmp_path / "v1").iterdir()]
    assert any(f.name == "model.safetensors" for f in files)
    modes = {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files}
    assert set(modes.values()) == {oct(umask_027)}, modes


def test_a_resume_drops_the_rows_a_stopped_job_logged_after_its_checkpoint(tmp_path):
    # A job checkpointed at step 3 and stopped during step 5 has logged steps 0-4; resumed, it
    # logs steps 3 and 4 again. The superseded rows go, so every step appears once and in order;
    # the evaluations at step 0 and at the checkpoint's step 3 (of the weights being resumed) stay.
    from areal_async.trainer.resume import drop_superseded_rows

    metrics = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "time": 1.0, "eval/pass@1": 0.1}]
    rows += [{"step": k, "time": 2.0 + k, "train/loss": float(k)} for k in range(5)]
    rows.insert(4, {"step": 3, "time": 4.5, "eval/pass@1": 0.3})  # after step 2's row, as the job logs it
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trajectories = tmp_path / "trajectories.jsonl"
    trajectories.write_text("".join(json.dumps({"step": k, "groups": []}) + "\n" for k in range(5)))

    assert drop_superseded_rows(metrics, 3) == 2
    assert drop_superseded_rows(trajectories, 3) == 2
    assert drop_superseded_rows(tmp_path / "absent.jsonl", 3) == 0 and not (tmp_path / "absent.jsonl").exists()
    kept = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert kept == rows[:5]
    assert [json.loads(x)["step"] for x in trajectories.read_text().splitlines()] == [0, 1, 2]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_resume_knows_whether_the_checkpoint_step_was_evaluated(tmp_path):
    # eval.every_steps: the evaluation of version 4 runs after step 3, overlapping step 4; a job
    # stopped then has a checkpoint at 4 but no eval row at 4, and the resumed run evaluates first
    from areal_async.trainer.resume import has_eval_row

    metrics = tmp_path / "metrics.jsonl"
    assert not has_eval_row(metrics, 4)
    rows = [{"step": 0, "eval/pass@1": 0.1}, {"step": 3, "train/loss": 0.0}, {"step": 4, "train/loss": 0.0}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert has_eval_row(metrics, 0) and not has_eval_row(metrics, 4)
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 4, "eval/pass@1": 0.2}) + "\n")
    assert has_eval_row(metrics, 4)


def test_a_checkpoint_keeps_the_base_models_generation_config_and_tokenizer_files(multi_eos_model_dir, tmp_path):
    # save_pretrained alone writes a generation config derived from config.json, one eos id (2)
    # where the base lists [2, 0]: a resumed run, or a user loading the checkpoint, stopped on fewer
    # tokens than the base model
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, GenerationConfig

    from areal_async.trainer.checkpoint import save_hf_checkpoint

    state = load_file(multi_eos_model_dir / "model.safetensors")
    out = save_hf_checkpoint(state, multi_eos_model_dir, tmp_path / "ckpt", torch.float32)
    gen = GenerationConfig.from_pretrained(out)
    assert (gen.eos_token_id, gen.temperature) == ([2, 0], 0.7)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (multi_eos_model_dir / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(out).chat_template == AutoTokenizer.from_pretrained(
        multi_eos_model_dir).chat_template


def _policy_and_optimizer():
    """A tiny policy (two linear layers) with the trainer's AdamW and schedule, the same at every call."""
    import torch

    from areal_async.config import TrainerConfig
    from areal_async.trainer.schedule import make_scheduler

    torch.manual_seed(0)
    policy = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    t = TrainerConfig()
    optimizer = torch.optim.AdamW(policy.parameters(), lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay)
    return policy, optimizer, make_scheduler(optimizer, t)


def _update(policy, optimizer, scheduler) -> None:
    """One training step on a fixed batch, as ``train_step`` and the loop take it."""
    import torch

    policy(torch.linspace(-1.0, 1.0, 32).reshape(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def _params(policy):
    return [p.detach().clone() for p in policy.parameters()]


def _same(a, b) -> bool:
    """Bit-equality of two (nested) optimizer state dicts or tensor lists."""
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_a_checkpoint_written_before_the_first_update_does_not_change_training(tmp_path):
    # Every update so far skipped (non-finite gradients): AdamW has no state. Writing the
    # checkpoint used to create one on the live optimizer (step 1, zero moments), so the next
    # update came out ~0.74x its size (bias correction of step 2: (0.1/0.19) / sqrt(0.001/0.001999)).
    from areal_async.trainer.resume import load_training_state, save_training_state

    policy, optimizer, scheduler = _policy_and_optimizer()
    never_saved = _policy_and_optimizer()
    start = _params(policy)
    save_training_state(policy, optimizer, scheduler, tmp_path, 0, [])
    assert not optimizer.state  # the live optimizer is as it was
    _update(policy, optimizer, scheduler)
    _update(*never_saved)
    assert not _same(_params(policy), start)  # the update moved the weights
    assert _same(_params(policy), _params(never_saved[0]))  # exactly as if never saved
    # loaded, the checkpoint gives an optimizer with no state either, whose update is the same
    resumed = _policy_and_optimizer()  # the weights of step 0 (a resume loads them separately)
    assert load_training_state(*resumed, tmp_path) == 0
    assert not resumed[1].state
    _update(*resumed)
    assert _same(_params(resumed[0]), _params(never_saved[0]))


def test_a_checkpoint_after_updates_restores_the_optimizer_bit_exactly_and_changes_nothing(tmp_path):
    from areal_async.trainer.resume import load_training_state, save_training_state

    policy, optimizer, scheduler = _policy_and_optimizer()
    never_saved = _policy_and_optimizer()
    for run in ((policy, optimizer, scheduler), never_saved):
        _update(*run)
        _update(*run)
    weights, state = {k: v.clone() for k, v in policy.state_dict().items()}, copy.deepcopy(optimizer.state_dict())
    save_training_state(policy, optimizer, scheduler, tmp_path, 2, [])
    assert _same(optimizer.state_dict(), state)  # saving changed nothing
    resumed = _policy_and_optimizer()
    resumed[0].load_state_dict(weights)
    assert load_training_state(*resumed, tmp_path) == 2
    assert _same(resumed[1].state_dict(), state)  # AdamW's step and both moments, bit for bit
    for run in ((policy, optimizer, scheduler), never_saved, resumed):
        _update(*run)
    assert _same(_params(policy), _params(never_saved[0]))
    assert _same(_params(resumed[0]), _params(never_saved[0]))


def test_a_resume_that_changes_the_schedule_gets_the_new_learning_rate_from_its_first_step(tmp_path):
    # Stopped at step 4 of a 20-step cosine run, resumed with trainer.total_steps=6 (the launcher's
    # own advice to train further): step 4 must take the 6-step schedule's rate, not the saved one.
    import torch

    from areal_async.config import TrainerConfig
    from areal_async.trainer.resume import load_training_state, save_training_state
    from areal_async.trainer.schedule import lr_factor, make_scheduler

    def run(total_steps: int, lr: float = 1e-5):
        torch.manual_seed(0)
        policy = torch.nn.Linear(4, 4)
        t = TrainerConfig(total_steps=total_steps, lr=lr, lr_schedule="cosine", warmup_steps=0)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=t.lr)
        return policy, optimizer, make_scheduler(optimizer, t), t

    policy, optimizer, scheduler, _ = run(20)
    for _ in range(4):
        _update_linear(policy, optimizer, scheduler)
    unbroken = optimizer.param_groups[0]["lr"]
    save_training_state(policy, optimizer, scheduler, tmp_path, 4, [])

    same = run(20)
    assert load_training_state(*same[:3], tmp_path) == 4
    assert same[1].param_groups[0]["lr"] == unbroken  # unchanged config: bit for bit the unbroken rate

    policy6, optimizer6, scheduler6, t6 = run(6, lr=2e-5)
    load_training_state(policy6, optimizer6, scheduler6, tmp_path)
    want = [2e-5 * lr_factor(k, "cosine", 0, 6, t6.min_lr_ratio) for k in (4, 5)]
    assert optimizer6.param_groups[0]["lr"] == want[0] != unbroken
    _update_linear(policy6, optimizer6, scheduler6)
    assert optimizer6.param_groups[0]["lr"] == want[1]


def _update_linear(policy, optimizer, scheduler) -> None:
    import torch

    policy(torch.ones(2, 4)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
