"""Shared fixtures: tiny causal LMs (2 layers, hidden 64) with a real byte-level BPE tokenizer,
built by ``tests/support/models.py`` (the tokenizer trained from a few GSM8K questions, no
downloads, with a chat template and an ``<|im_end|>`` end-of-sequence token, so prompts are built
the same way as for real models), and settings a test opts into (one torch thread, a umask).
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

# Without a GPU, Triton kernels (installed with the dev extra) run in Triton's CPU interpreter, so
# the engine's CUDA kernels are checked on every machine; it must be chosen before they are defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the harness's asserts explain their failures as the tests' own do; before any of it is imported
pytest.register_assert_rewrite("tests.support")

from tests.support.models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random Llama checkpoint directory (fp32), built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> pathlib.Path:
    """A tiny random Qwen3 checkpoint directory (fp32, q/k norms), built once per test session."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture
def multi_eos_model_dir(tiny_model_dir, tmp_path) -> pathlib.Path:
    """A copy of the tiny Llama whose ``generation_config.json`` lists two end-of-sequence ids,
    ``[<|im_end|>, <|endoftext|>]`` = ``[2, 0]``, where ``config.json`` has one (2), as Qwen2.5 /
    Qwen3 releases do, plus a sampling default (``temperature`` 0.7)."""
    import shutil

    out = shutil.copytree(tiny_model_dir, tmp_path / "multi-eos")
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 == json.loads((out / "config.json").read_text())["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 0], "temperature": 0.7},
                                                           indent=2) + "\n")
    return out


@pytest.fixture(scope="session")
def tok(tiny_model_dir):
    """The tiny model's tokenizer (ChatML template); read only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def one_torch_thread():
    """Run the test with one intra-op thread (the servers' setting on a shared CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def umask_027() -> int:
    """Run the test under umask 027; returns the mode a new file then gets (0o640)."""
    before = os.umask(0o027)
    yield 0o640
    os.umask(before)


@pytest.fixture(scope="module")
def det_runs(tiny_model_dir, tmp_path_factory):
    """``det_runs[mode, jitter_seed]``: the fingerprint of that undisturbed determinism job
    (``tests/support/jobs.py``), run once per pytest run, on first use, and shared by the test
    processes (``tests/support/determinism.py``)."""
    from tests.support.determinism import SharedJobRuns, shared_root

    runs = SharedJobRuns(tiny_model_dir, shared_root(tmp_path_factory))
    yield runs
    runs.close()
