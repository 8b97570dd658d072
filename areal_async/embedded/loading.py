"""Building an ``Engine`` from an HF causal-LM directory: ``load_engine`` loads the model and its
tokenizer, collects the end-of-sequence ids (model config, tokenizer, ``generation_config.json``) and
sizes the KV cache and the prefix cache. Used by the server's command line (``server.py``), the tests
and the benchmarks.
"""

from __future__ import annotations

import torch

from ..dtypes import FLOAT_DTYPES
from ..jitter import Jitter
from ..config import DEFAULT_MAX_QUEUED
from .engine.engine import Engine
from .engine.forward import BatchedForward


def load_engine(
    model_path: str,
    dtype: str = "bfloat16",
    device: str = "cpu",
    max_running_requests: int = 32,
    max_seq_len: int = 1024,
    max_prefill_tokens: int = 4096,
    weight_version: int = 0,
    deterministic: bool = False,
    jitter: Jitter | None = None,
    cuda_graph: bool = True,
    prefix_cache: bool = True,
    prefix_cache_entries: int = 8,
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED,
):
    """Load an HF causal-LM directory into an ``Engine``; returns ``(engine, tokenizer)``.

    ``deterministic``: batch-invariant forward (see ``forward.py``); ``jitter``: per-step delays;
    ``cuda_graph``: replay captured decode steps on CUDA (``cuda_graph.py``); ``prefix_cache``:
    reuse prompts' keys and values (``engine.py``), in ``prefix_cache_entries`` extra KV rows;
    ``max_queued_requests``: requests that may wait for a KV slot (``admission.py``; ``None``: no bound).

    Raises:
        ValueError: unknown dtype, ``prefix_cache_entries < 1`` with the prefix cache on,
            ``max_queued_requests < 1``, or an unsupported architecture.
    """
    if prefix_cache and prefix_cache_entries < 1:
        raise ValueError(f"prefix_cache_entries {prefix_cache_entries}: the prefix cache needs at least one "
                         f"entry; give prefix_cache_entries >= 1, or turn the prefix cache off")
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a "Loading weights" bar per process clutters the job's console

    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported; use one of {sorted(FLOAT_DTYPES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=FLOAT_DTYPES[dtype]).to(device).eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos: set[int] = set()
    sources = [model.config.eos_token_id, tokenizer.eos_token_id]
    try:
        sources.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    for ids in sources:
        eos.update([ids] if isinstance(ids, int) else (ids or []))
    # deterministic mode reuses only a prompt repeated within a step, which needs no rows (engine.py)
    rows = prefix_cache_entries if prefix_cache and not deterministic else 0
    forward = BatchedForward(model, max_running_requests, max_seq_len, batch_invariant=deterministic,
                             cuda_graph=cuda_graph, prefix_rows=rows)
    return Engine(forward, eos, max_prefill_tokens, weight_version, jitter, prefix_cache, tokenizer,
                  max_queued_requests), tokenizer
