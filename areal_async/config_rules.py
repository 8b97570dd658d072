"""Rules of a config that span several fields (``check_config``), checked by ``config.from_dict``
after the types; each raises ``ValueError`` naming the keys, the rule and the fix."""

from __future__ import annotations

import ipaddress
import math
import pathlib

import msgspec

from areal_async.config_hints import finite_rule
from areal_async.determinism import check_compile

LORA_COMPILE_RULE = ("trainer.lora.rank > 0 with trainer.compile=true: compiling peft's LoRA layers is not "
                     "supported here (not tested); set trainer.compile=false")


def _non_finite(struct: msgspec.Struct, prefix: str = "") -> tuple[str, float] | None:
    """The first float field (dotted key, value) anywhere in ``struct`` that is inf or NaN."""
    for field in msgspec.structs.fields(struct):
        value = getattr(struct, field.name)
        key = f"{prefix}{field.name}"
        if isinstance(value, msgspec.Struct):
            found = _non_finite(value, key + ".")
            if found:
                return found
        for v in value if isinstance(value, tuple) else (value,):
            if isinstance(v, float) and not math.isfinite(v):
                return key, v
    return None


# Largest seed: numpy's default_rng (prompt order, jitter) and the prompt set need seed >= 0, and
# torch.manual_seed takes at most 64 bits; a signed int64 also survives every 64-bit serialiser.
SEED_MAX = 2**63 - 1


def _check_lora_on_sglang(cfg) -> None:
    """A LoRA job on SGLang loads each adapter version from disk, generation paused (docs/lora_sync.md)."""
    rank = cfg.trainer.lora.rank
    if cfg.trainer.weight_sync != "disk":
        raise ValueError(f"trainer.lora.rank={rank} with inference.backend=sglang and trainer.weight_sync="
                         f"{cfg.trainer.weight_sync!r}: SGLang 0.5.23 has no distributed LoRA update (its load "
                         f"from tensors takes same-host handles only); set trainer.weight_sync=disk (each adapter "
                         f"version written to RUN_DIR/adapters and loaded by every server)")
    if not cfg.rollout.interrupt_on_update:
        raise ValueError(f"trainer.lora.rank={rank} with inference.backend=sglang and rollout.interrupt_on_update="
                         f"false: SGLang replaces an adapter by unloading and loading it, and a request between "
                         f"the two would reload the previous version; set rollout.interrupt_on_update=true")


def check_config(cfg) -> None:
    """Rules that span several fields; raises ``ValueError`` naming the keys and the fix."""
    bad = _non_finite(cfg)
    if bad:
        raise ValueError(finite_rule(*bad))
    for key, seed in (("seed", cfg.seed), ("debug.jitter_seed", cfg.debug.jitter_seed)):
        if not 0 <= seed <= SEED_MAX:
            raise ValueError(f"{key}={seed} must be in [0, 2**63 - 1] (numpy's default_rng needs a seed >= 0, "
                             f"torch.manual_seed one of at most 64 bits); choose e.g. {key}=1")
    if not cfg.name:
        raise ValueError("name='' must be a non-empty string: the run directory's name under run_root, "
                         "e.g. name=exp1")
    if pathlib.PurePath(cfg.name).name != cfg.name or cfg.name in (".", ".."):
        raise ValueError(f"name '{cfg.name}' must be a plain directory name (no '/' or '..'); "
                         f"use run_root to put runs elsewhere")
    r = cfg.rollout
    if not 0.0 < r.top_p <= 1.0:
        raise ValueError(f"rollout.top_p={r.top_p} must be in (0, 1]; 1.0 keeps the whole vocabulary")
    if r.top_k == 0 or r.top_k < -1:
        raise ValueError(f"rollout.top_k={r.top_k} must be -1 (the whole vocabulary) or >= 1")
    if r.workflow and r.tools:
        raise ValueError(f"rollout.tools={list(r.tools)} are the default workflow's; rollout.workflow="
                         f"{r.workflow!r} runs its own (areal_async.tools from its code): set rollout.tools=[]")
    if r.workflow and (cfg.reward.fn or cfg.reward.graded):
        given = [k for k, on in (("reward.fn", cfg.reward.fn), ("reward.graded", cfg.reward.graded)) if on]
        raise ValueError(f"{' and '.join(given)} apply to the default workflow's reward; rollout.workflow="
                         f"{r.workflow!r} returns its own rewards (Env.step or run's return value), so "
                         f"they would have no effect: unset them, or score inside the workflow")
    if r.on_env_error != "raise" and not r.workflow:
        raise ValueError(f"rollout.on_env_error={r.on_env_error!r} applies to rollout.workflow's Env or run; the "
                         f"default workflow calls no environment (a failing tool is an error observation, "
                         f"rollout/tool_errors): set rollout.workflow, or unset rollout.on_env_error")
    if r.n_samples < 2:
        raise ValueError(f"rollout.n_samples={r.n_samples}: GRPO normalises rewards within a group, so one "
                         f"sample per prompt gives every advantage 0; use rollout.n_samples >= 2")
    if cfg.algo.kl_coef != 0.0:
        raise ValueError(f"algo.kl_coef={cfg.algo.kl_coef}: a KL penalty needs a reference model, which this "
                         f"trainer does not keep; set algo.kl_coef=0")
    a = cfg.algo
    if a.ppo_minibatches > cfg.queue.batch_size:
        raise ValueError(f"algo.ppo_minibatches={a.ppo_minibatches} is more than queue.batch_size="
                         f"{cfg.queue.batch_size}: each minibatch holds whole groups of a step's batch; lower "
                         f"algo.ppo_minibatches to {cfg.queue.batch_size} or fewer, or raise queue.batch_size")
    for low, high in (("mis_seq_ratio_low", "mis_seq_ratio_high"), ("icepop_ratio_low", "icepop_ratio_high")):
        if getattr(a, low) >= getattr(a, high):
            raise ValueError(f"algo.{low}={getattr(a, low)} must be below algo.{high}={getattr(a, high)}: "
                             f"the kept range [low, high] would be empty; e.g. algo.{low}=0.5")
    if not all(0.0 <= b < 1.0 for b in cfg.trainer.adam_betas):
        raise ValueError(f"trainer.adam_betas={list(cfg.trainer.adam_betas)} must both be in [0, 1), "
                         f"e.g. [0.9, 0.999]")
    if cfg.trainer.lora.rank and cfg.trainer.compile:
        raise ValueError(LORA_COMPILE_RULE)
    if cfg.trainer.lora.rank and cfg.inference.backend == "sglang":
        _check_lora_on_sglang(cfg)
    if cfg.trainer.warmup_steps > cfg.trainer.total_steps:
        raise ValueError(f"trainer.warmup_steps={cfg.trainer.warmup_steps} is more than trainer.total_steps="
                         f"{cfg.trainer.total_steps}: the run would end before reaching trainer.lr; lower "
                         f"trainer.warmup_steps (e.g. to {max(1, cfg.trainer.total_steps // 10)})")
    check_compile(cfg.trainer.compile, cfg.mode == "deterministic")
    for role in ("server", "queue", "trainer", "worker"):
        node = getattr(cfg.cluster, f"{role}_node")
        try:
            node and ipaddress.ip_address(node)
        except ValueError:
            raise ValueError(f"cluster.{role}_node={node!r} is not an IP address; give the address of a "
                             f"node of the Ray cluster (`ray status` lists them), e.g. cluster.{role}_node="
                             f"10.0.0.2, or '' to let cluster.placement choose") from None
    last_port = cfg.inference.base_port + cfg.inference.num_servers - 1
    if last_port > 65535:
        raise ValueError(f"inference.base_port ({cfg.inference.base_port}) + inference.num_servers "
                         f"({cfg.inference.num_servers}) - 1 = {last_port} is above 65535; lower inference.base_port")
    need = cfg.data.max_prompt_len + max(cfg.rollout.max_new_tokens, cfg.eval.max_new_tokens)
    if cfg.inference.backend == "embedded" and need > cfg.inference.max_seq_len:
        raise ValueError(
            f"data.max_prompt_len ({cfg.data.max_prompt_len}) + max(rollout.max_new_tokens, "
            f"eval.max_new_tokens) ({need - cfg.data.max_prompt_len}) = {need} exceeds "
            f"inference.max_seq_len ({cfg.inference.max_seq_len}); raise inference.max_seq_len "
            f"or lower the others")
