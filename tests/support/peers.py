"""The peers' own loss code (verl, AReaL, TRL), loaded beside this project's for the parity tests.

``bash tools/peers/install.sh`` puts their packages, without dependencies, in ``.peers``. Their
loss modules import heavy packages at import time (hydra, tensordict, ray, the peers' trainers),
so ``load`` executes one module file under its own name with placeholders for the imports it
names and nothing else: a placeholder module holds the given attributes (``STUB``: any attribute
is a ``MagicMock``, for names a module imports but the loss functions never use). The modules
added to ``sys.modules`` for the load are removed after it; the loaded module keeps its
references. Their code is run, never copied.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from unittest import mock

import pytest

from tests.support import REPO

PEERS = REPO / ".peers"
PINS = {"verl": "0.9.1", "areal": "1.0.4", "trl": "1.16.0"}
INSTALL = "bash tools/peers/install.sh"


class _Any(types.ModuleType):
    """A placeholder module: every attribute not set is a ``MagicMock``."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


STUB = object()  # as a stub's attributes (or under "*" beside some): every other attribute a MagicMock


def require() -> None:
    """Fail (never skip) the calling test when ``.peers`` lacks a pinned package, naming the fix."""
    missing = [f"{n}=={v}" for n, v in PINS.items() if not (PEERS / f"{n}-{v}.dist-info").is_dir()]
    if missing:
        pytest.fail(f"the peers' packages {', '.join(missing)} are not in {PEERS}: run `{INSTALL}` "
                    f"from the project's root (the parity tests compare with their code)", pytrace=False)


def load(name: str, relpath: str, stubs: dict[str, dict | object] | None = None) -> types.ModuleType:
    """Execute ``.peers/<relpath>`` as module ``name``, with ``stubs`` (module name → attributes,
    ``STUB``, or a module loaded before) in ``sys.modules`` while it runs, in place of any module
    of that name imported already (put back afterwards)."""
    require()
    stubs = dict(stubs or {})
    saved = {n: sys.modules.get(n) for n in [*stubs, name]}
    for mod_name, attrs in stubs.items():
        if isinstance(attrs, types.ModuleType):
            sys.modules[mod_name] = attrs
            continue
        attrs = {"*": STUB} if attrs is STUB else attrs
        mod = _Any(mod_name) if attrs.get("*") is STUB else types.ModuleType(mod_name)
        mod.__dict__.update({k: v for k, v in attrs.items() if k != "*"})
        sys.modules[mod_name] = mod
    for mod_name in stubs:  # a package stub answers ``import a.b.c as x`` through its children
        parent, _, child = mod_name.rpartition(".")
        if parent in stubs:
            setattr(sys.modules[parent], child, sys.modules[mod_name])
    spec = importlib.util.spec_from_file_location(name, PEERS / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        for mod_name, before in saved.items():
            if before is None:
                sys.modules.pop(mod_name, None)
            else:
                sys.modules[mod_name] = before
    return module


class VerlActorConfig:
    """What verl's policy losses read of their ``ActorConfig`` (``clip_ratio*``, ``global_batch_info``)."""

    def __init__(self, clip_ratio: float, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None,
                 **extra):
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = clip_ratio, clip_ratio_low, clip_ratio_high
        self.global_batch_info: dict = {}
        self._extra = extra

    def get(self, key: str, default=None):
        return self._extra.get(key, default)


class _VerlAlgoConfig:
    """verl's ``AlgoConfig``, which its losses only test ``isinstance`` against."""


def verl() -> tuple[types.ModuleType, types.ModuleType]:
    """``(core_algos, rollout_corr_helper)`` of verl: its policy losses, ``agg_loss``, and its
    rollout-correction weights and rejection masks, with its own ``torch_functional``."""
    torch_functional = load("verl.utils.torch_functional", "verl/utils/torch_functional.py", {
        "tensordict": {"TensorDict": dict}, "transformers": {"PreTrainedTokenizer": object}, "verl": {},
        "verl.utils": {}, "verl.utils.device": STUB,
    })
    common = {"verl": {}, "verl.utils": STUB, "verl.utils.torch_functional": torch_functional,
              "verl.trainer": {}, "verl.workers": {}, "omegaconf": {"DictConfig": dict}}
    core = load("verl.trainer.ppo.core_algos", "verl/trainer/ppo/core_algos.py", {
        **common, "verl.trainer.config": {"AlgoConfig": _VerlAlgoConfig}, "verl.utils.import_utils": STUB,
        "verl.workers.config": {"ActorConfig": VerlActorConfig},
    })
    helper = load("verl.trainer.ppo.rollout_corr_helper", "verl/trainer/ppo/rollout_corr_helper.py", {
        **common, "verl.protocol": STUB, "verl.trainer.config": {}, "verl.trainer.config.algorithm": STUB,
        "verl.workers.config": {}, "verl.workers.config.actor": STUB,
    })
    return core, helper


def areal() -> tuple[types.ModuleType, types.ModuleType]:
    """``(functional, actor)`` of AReaL: ``ppo_actor_loss_fn`` (decoupled PPO, rejection sampling,
    GSPO's sequence level) and the PPO actor's M2PO mask (``_apply_m2po_masking``)."""
    functional = load("areal.utils.functional.functional", "areal/utils/functional/functional.py", {
        "areal": {}, "areal.api": {}, "areal.api.cli_args": STUB, "areal.utils": {}, "areal.utils.data": STUB,
    })
    actor = load("areal.trainer.ppo.actor", "areal/trainer/ppo/actor.py", {
        name: STUB for name in (
            "areal", "areal.api", "areal.api.cli_args", "areal.experimental",
            "areal.experimental.training_service", "areal.experimental.training_service.controller",
            "areal.experimental.training_service.controller.controller", "areal.infra", "areal.infra.rpc",
            "areal.infra.rpc.serialization", "areal.trainer", "areal.trainer.ppo", "areal.trainer.ppo.stats",
            "areal.utils", "areal.utils.constants", "areal.utils.data", "areal.utils.functional",
            "areal.utils.perf_tracer")})
    return functional, actor


def trl() -> types.ModuleType:
    """TRL's ``grpo_trainer`` module: ``GRPOTrainer._compute_loss`` is its GRPO loss, a method
    that reads the trainer's settings from ``self`` and the θ log-probs from its
    ``_get_per_token_logps_and_entropies`` (both supplied by the caller)."""
    stubs = {name: STUB for name in (
        "pandas", "accelerate", "accelerate.logging", "accelerate.utils", "datasets", "huggingface_hub",
        "transformers.trainer_utils", "trl.chat_template_utils", "trl.data_utils", "trl.distributed", "trl.extras",
        "trl.extras.profiling", "trl.generation", "trl.generation.vllm_generation", "trl.import_utils",
        "trl.models", "trl.models.utils", "trl.trainer.callbacks", "trl.trainer.grpo_config", "trl.trainer.utils")}
    never = lambda: False  # noqa: E731 — no optional integration (peft, wandb, ...) is imported
    stubs.update({"trl": {}, "trl.trainer": {}, "trl.trainer.base_trainer": {"_BaseTrainer": object},
                  "transformers": {"*": STUB, "is_trackio_available": never, "is_wandb_available": never},
                  "transformers.utils": {"*": STUB, "is_peft_available": never, "is_rich_available": never}})
    return load("trl.trainer.grpo_trainer", "trl/trainer/grpo_trainer.py", stubs)


__all__ = ["INSTALL", "PEERS", "PINS", "VerlActorConfig", "areal", "load", "require", "trl", "verl"]
