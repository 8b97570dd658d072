"""Config tree: YAML + dotted overrides, unknown keys named with the closest valid key."""

import re

import pytest

from areal_async.config import Config, dump_config, load_config
from areal_async.devices import GPU_DRIVER_NODES


def test_defaults_and_override(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("name: abl\nqueue:\n  max_staleness: 4\n  batch_size: 2\n")
    cfg = load_config(path, ["queue.max_staleness=2", "algo.eps_clip_high=0.28", "mode=deterministic"])
    assert cfg.queue.max_staleness == 2 and cfg.queue.batch_size == 2
    assert cfg.algo.eps_clip_high == 0.28 and cfg.mode == "deterministic"
    assert cfg.rollout == Config().rollout
    dump_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("queue.max_stalenes=2", "did you mean 'queue.max_staleness'"),
        ("queu.batch_size=2", "did you mean 'queue'"),
        ("trainer.lr.x=1", "'trainer.lr' is a value"),
        ("queue=3", "is a section"),
        ("noequals", "must look like"),
        ("mode=fast", "invalid config"),
        ("queue.batch_size=abc", "invalid config"),
        ("queue.batch_size=0", "'queue.batch_size' = 0: Expected `int` >= 1"),
        ("queue.max_staleness=-1", "'queue.max_staleness' = -1: Expected `int` >= 0"),
        ("rollout.num_workers=0", "'rollout.num_workers'"),
        ("trainer.lr=0", "'trainer.lr' = 0: Expected `float` > 0"),
        ("name=../elsewhere", "plain directory name"),
        ("rollout.max_new_tokens=900", "exceeds inference.max_seq_len \\(1024\\)"),
    ],
)
def test_bad_keys_and_values(override, expected):
    with pytest.raises(ValueError, match=expected):
        load_config(None, [override])


def test_nccl_weight_sync_needs_one_gpu_per_process():
    from launcher.resolve import check_devices

    one_gpu = load_config(None, ["inference.device=cuda:0", "trainer.device=cuda"])
    with pytest.raises(ValueError, match=r"cuda:0.*trainer rank 0.*trainer.weight_sync=disk"):
        check_devices(one_gpu, cuda_available=True)
    with pytest.raises(ValueError, match="trainer rank 0"):  # "auto" resolves to cuda:0 on a GPU machine
        check_devices(load_config(None, []), cuda_available=True)
    check_devices(load_config(None, []), cuda_available=False)  # CPU: gloo, no constraint
    check_devices(load_config(None, ["inference.device=cuda:0", "trainer.device=cuda", "trainer.weight_sync=disk"]),
                  cuda_available=True)
    check_devices(load_config(None, ["inference.device=cuda:1", "trainer.device=cuda"]), cuda_available=True)
    with pytest.raises(ValueError, match="inference.num_servers=2"):
        check_devices(load_config(None, ["inference.device=cuda:2", "trainer.device=cuda", "inference.num_servers=2"]),
                      cuda_available=True)


def test_under_ray_with_gpu_bundles_every_process_has_its_own_gpu():
    # launcher.ray, the two-node recipe of docs/ray.md: 4 ranks and 4 servers, each bundle with its own
    # GPU (seen as cuda:0), launched from a node that may have none: NCCL weight sync is allowed.
    from launcher.resolve import check_devices

    over = ["inference.device=cuda", "trainer.device=cuda", "trainer.nproc=4", "inference.num_servers=4",
            "cluster.gpus_per_server=1", "cluster.gpus_per_trainer_rank=1"]
    check_devices(load_config(None, over), cuda_available=False, own_gpus=True)
    with pytest.raises(ValueError, match="inference.num_servers=4"):  # without Ray's isolation: all on one GPU
        check_devices(load_config(None, over), cuda_available=True)
    with pytest.raises(ValueError, match=r"inference.device='cuda:1', but each server's Ray bundle holds its own "
                                         r"GPUs .*use inference.device=cuda"):
        check_devices(load_config(None, [*over, "inference.device=cuda:1"]), cuda_available=False, own_gpus=True)


def test_device_strings_are_checked_and_dtypes_resolved(monkeypatch):
    from launcher import resolve as resolve_module
    from launcher.resolve import check_devices, resolve_dtypes

    with pytest.raises(ValueError, match=r"inference.device='cuda:x' is not a device"):
        check_devices(load_config(None, ["inference.device=cuda:x"]), cuda_available=True)
    with pytest.raises(ValueError, match="no CUDA device"):
        check_devices(load_config(None, ["inference.device=cuda"]), cuda_available=False)
    with pytest.raises(ValueError, match="rank r always runs on cuda:r"):
        check_devices(load_config(None, ["trainer.device=cuda:1", "trainer.weight_sync=disk"]), cuda_available=True)
    with pytest.raises(ValueError, match="same kind of device"):
        check_devices(load_config(None, ["inference.device=cpu", "trainer.device=cuda"]), cuda_available=True)
    auto = load_config(None, ["model.dtype=auto", "trainer.dtype=auto", "inference.device=cpu", "trainer.device=cpu"])
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(resolve_module, "cpu_has_bf16", lambda native=native: native)
        resolved = resolve_dtypes(auto, cuda_available=False)
        assert (resolved.model.dtype, resolved.trainer.dtype) == (expected, expected)
    gpu = resolve_dtypes(load_config(None, ["model.dtype=auto", "inference.device=cuda:1"]), cuda_available=True)
    assert gpu.model.dtype == "bfloat16" and gpu.trainer.dtype == "float32"  # an explicit value stays


@pytest.mark.parametrize("node", [None, *GPU_DRIVER_NODES])
def test_cuda_is_asked_of_torch_only_where_a_gpu_driver_is(monkeypatch, node):
    import os

    import torch

    from areal_async import devices

    monkeypatch.setattr(devices.sys, "platform", "linux")
    monkeypatch.setattr(devices.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(devices.os.path, "exists", lambda path: path == node)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert devices.cuda_available() is (node is not None)
    monkeypatch.setattr(devices.platform, "machine", lambda: "aarch64")  # a Jetson has none of the nodes
    assert devices.cuda_available() is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices.cuda_available() is False
    monkeypatch.undo()
    if not any(os.path.exists(n) for n in devices.GPU_DRIVER_NODES):  # this machine: no GPU driver
        assert devices.cuda_available() is torch.cuda.is_available() is False


@pytest.mark.parametrize("override, message", [
    ("rollout.top_p=5", "rollout.top_p=5"), ("rollout.top_k=0", "rollout.top_k=0"),
    ("rollout.n_samples=1", "n_samples >= 2"), ("algo.eps_clip=-0.5", "eps_clip"),
])
def test_sampling_and_algorithm_values_are_checked_at_load(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("override, given", [
    ("reward.graded=true", "reward.graded apply"), ("reward.fn=math", "reward.fn apply")])
def test_reward_keys_a_workflow_would_ignore_are_refused(override, given):
    workflow = "rollout.workflow=examples.workflows.calculator_env:CalculatorEnv"
    with pytest.raises(ValueError, match=f"{given} to the default workflow's reward;.* unset them"):
        load_config(None, [workflow, "rollout.tools=[]", override])
    load_config(None, [workflow, "rollout.tools=[]"])  # no reward key: loads


def test_compile_is_refused_in_deterministic_mode_at_load():
    with pytest.raises(ValueError, match=r"trainer.compile=true is not supported with mode: deterministic.*"
                                         r"set trainer.compile=false"):
        load_config(None, ["mode=deterministic", "trainer.compile=true"])
    assert load_config(None, ["mode=throughput", "trainer.compile=true"]).trainer.compile


def test_server_ports_past_65535_and_non_yaml_files_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"= 65536 is above 65535; lower inference.base_port"):
        load_config(None, ["inference.base_port=65535", "inference.num_servers=2"])
    bad = tmp_path / "notes.md"
    bad.write_text("# title\n\n| a | b |\n: not yaml : [\n")
    with pytest.raises(ValueError, match="is not a YAML config file"):
        load_config(bad)


def test_bad_values_are_named_with_what_was_given_and_the_choices():
    with pytest.raises(ValueError, match=r"'queue.max_staleness' = -1: Expected `int` >= 0"):
        load_config(None, ["queue.max_staleness=-1"])
    with pytest.raises(ValueError, match=r"'mode' = 'determinstic'.*choose one of \['deterministic', 'throughput'\]"):
        load_config(None, ["mode=determinstic"])


@pytest.mark.parametrize("override, value", [("name=123", "123"), ("data.task=1.5", "1.5"),
                                             ("model.path=true", "true")])
def test_a_number_for_a_text_key_says_how_to_quote_it(override, value):
    # YAML reads name=123 as the int 123; the error gives the command-line form that makes it text,
    # and that form, split as a POSIX shell splits it, loads
    import re
    import shlex

    key = override.split("=")[0]
    with pytest.raises(ValueError, match=re.escape(f"'{key}' = ")) as info:
        load_config(None, [override])
    given = re.search(r"quote it: (.+?) on the command line", str(info.value))
    assert given, str(info.value)
    assert shlex.split(given.group(1)) == [f'{key}="{value}"']
    node = load_config(None, shlex.split(given.group(1)))
    for part in key.split("."):
        node = getattr(node, part)
    assert node == value


@pytest.mark.parametrize("override", ["seed=-1", f"seed={2**63}", f"seed={2**64}", "debug.jitter_seed=-1"])
def test_a_seed_every_consumer_cannot_take_fails_at_load(override):
    # -1 passed the load and stopped a worker later (PromptSet, numpy's default_rng need seed >= 0);
    # 2**64 is refused by torch.manual_seed
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=re.escape(f"{override} must be in [0, 2**63 - 1]") + f".*{key}=1"):
        load_config(None, [override])


def test_the_largest_seed_reaches_every_consumer():
    import random

    import numpy as np
    import torch

    from areal_async.config import SEED_MAX
    from areal_async.types import sample_seed

    cfg = load_config(None, [f"seed={SEED_MAX}", f"debug.jitter_seed={SEED_MAX}"])
    torch.manual_seed(cfg.seed)
    np.random.default_rng([cfg.seed, 3])
    random.Random(cfg.seed)
    assert 0 <= sample_seed(cfg.seed, 5, 1) < 2**63


@pytest.mark.parametrize("override", ["trainer.lr=.nan", "trainer.lr=nan", "trainer.lr=.inf", "trainer.lr=-inf",
                                      "algo.eps_clip_high=.nan", "debug.jitter_ms=nan", "reward.correct=.nan"])
def test_inf_and_nan_get_one_message_whatever_the_range_of_the_key(override):
    # NaN used to fail the key's range constraint first (nan > 0 is false): "Expected `float` > 0.0"
    key, _, given = override.partition("=")
    value = float(given.replace(".", ""))
    with pytest.raises(ValueError, match=re.escape(f"{key}={value}: must be a finite number")):
        load_config(None, [override])


@pytest.mark.parametrize("override, words", [
    ("name=", "name must be a non-empty string, e.g. name=default"),
    ('name=""', "name='' must be a non-empty string"),
    ("trainer.lr=", "trainer.lr must be a value, e.g. trainer.lr=1e-06"),
    ("reward.fn=", "'reward.fn=\"\"' for an empty string"),
])
def test_an_empty_value_says_what_to_give(override, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        load_config(None, [override])


def test_tree_attention_auto_and_its_errors():
    from areal_async.trainer.tree_paths import tree_attention_choice
    from launcher.resolve import resolve_tree_attention

    assert tree_attention_choice("auto", True, "bfloat16", False) == "varlen"
    assert tree_attention_choice("auto", True, "auto", False) == "varlen"
    assert tree_attention_choice("auto", True, "float16", True) == "sdpa"  # deterministic
    assert tree_attention_choice("auto", True, "float32", False) == "sdpa"
    assert tree_attention_choice("auto", False, "bfloat16", False) == "sdpa"
    assert tree_attention_choice("flex", True, "bfloat16", False) == "flex"
    assert tree_attention_choice("sdpa", False, "float32", True) == "sdpa"
    for args, why in ((("varlen", False, "bfloat16", False), "runs on CPU"),
                      (("flex", True, "float32", False), "trainer.dtype=float32"),
                      (("varlen", True, "bfloat16", True), "deterministic")):
        with pytest.raises(ValueError, match=f"trainer.tree_attention={args[0]} needs CUDA.*{why}"):
            tree_attention_choice(*args)
    with pytest.raises(ValueError, match="not a path"):
        tree_attention_choice("dense", True, "bfloat16", False)
    cfg = load_config(None, ["trainer.device=cpu"])
    assert resolve_tree_attention(cfg, cuda_available=False).trainer.tree_attention == "sdpa"
    with pytest.raises(ValueError, match="runs on CPU"):
        resolve_tree_attention(load_config(None, ["trainer.tree_attention=varlen"]), cuda_available=False)


def test_server_health_check_and_restart_keys_default_and_reject_bad_values():
    inf = load_config(None, []).inference
    assert (inf.health_check_interval_s, inf.max_server_restarts) == (10.0, 3)
    assert load_config(None, ["inference.max_server_restarts=0"]).inference.max_server_restarts == 0
    with pytest.raises(ValueError, match=r"'inference.health_check_interval_s' = 0.0: Expected `float` > 0"):
        load_config(None, ["inference.health_check_interval_s=0.0"])
    with pytest.raises(ValueError, match=r"'inference.max_server_restarts' = -1: Expected `int` >= 0"):
        load_config(None, ["inference.max_server_restarts=-1"])
    with pytest.raises(ValueError, match="inference.max_server_restarts"):  # the closest valid name
        load_config(None, ["inference.max_server_restart=1"])
    assert inf.server_rejoin_timeout_s == 300.0
    assert load_config(None, ["inference.server_rejoin_timeout_s=0"]).inference.server_rejoin_timeout_s == 0
    with pytest.raises(ValueError, match=r"'inference.server_rejoin_timeout_s' = -1.0: Expected `float` >= 0"):
        load_config(None, ["inference.server_rejoin_timeout_s=-1.0"])


@pytest.mark.parametrize("role", ["server", "queue", "trainer", "worker"])
def test_a_node_pin_that_is_no_ip_address_fails_at_load(role):
    # launcher.ray pins through Ray's node:<ip> resource: a host name would never be granted
    with pytest.raises(ValueError, match=rf"cluster.{role}_node='node-b' is not an IP address.*cluster.{role}_node=10"):
        load_config(None, [f"cluster.{role}_node=node-b"])
    assert getattr(load_config(None, [f"cluster.{role}_node=10.0.0.2"]).cluster, f"{role}_node") == "10.0.0.2"


def test_a_key_given_twice_in_one_mapping_is_refused_naming_it_and_its_lines(tmp_path):
    # PyYAML keeps the last of the two silently: total_steps was 4
    path = tmp_path / "exp.yaml"
    path.write_text("name: a\ntrainer:\n  total_steps: 3\n  lr: 1.0e-6\n  total_steps: 4\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}: key 'total_steps' is given twice in one mapping "
                                                   f"(line 3 and line 5), and YAML would keep the last; keep one")):
        load_config(path)
    path.write_text("name: a\ntrainer:\n  total_steps: 3\nname: b\n")
    with pytest.raises(ValueError, match=re.escape("key 'name' is given twice in one mapping (line 1 and line 4)")):
        load_config(path)
    path.write_text("trainer:\n  total_steps: 3\nqueue:\n  total_steps: 3\n")  # one key in two mappings: fine
    with pytest.raises(ValueError, match="unknown config key 'queue.total_steps'"):
        load_config(path)


@pytest.mark.parametrize("given, replacement", [(True, "algo.objective=decoupled"), (False, "algo.objective=naive")])
def test_the_replaced_algo_decoupled_names_algo_objective(tmp_path, given, replacement):
    # An old config (or override) with the boolean algo.decoupled is refused, never read as a
    # default objective: the error names the key and what replaces it, for either value.
    path = tmp_path / "old.yaml"
    path.write_text(f"algo:\n  decoupled: {'true' if given else 'false'}\n")
    for args in ((path, []), (None, [f"algo.decoupled={'true' if given else 'false'}"])):
        with pytest.raises(ValueError, match="config key 'algo.decoupled' is gone: give algo.objective") as err:
            load_config(*args)
        assert replacement in str(err.value)


def test_objectives_and_their_knobs_load_and_bad_ranges_are_named():
    cfg = load_config(None, ["algo.objective=icepop", "algo.icepop_ratio_low=0.25", "algo.icepop_ratio_high=8"])
    assert (cfg.algo.objective, cfg.algo.icepop_ratio_low, cfg.algo.icepop_ratio_high) == ("icepop", 0.25, 8.0)
    with pytest.raises(ValueError, match="algo.objective.*choose one of \\['decoupled', 'naive', 'tis', 'mis', "
                                         "'icepop', 'm2po', 'gspo'\\]"):
        load_config(None, ["algo.objective=ppo"])
    with pytest.raises(ValueError, match="algo.mis_seq_ratio_low=3.0 must be below algo.mis_seq_ratio_high=2.0"):
        load_config(None, ["algo.mis_seq_ratio_low=3"])
