"""The test suite's shared harness; test modules import from here, never from one another.

- ``models``: the tiny models' builder (2 layers, hidden 64, a trained BPE tokenizer) and what
  tests do with a tiny model: a chat prompt's ids, a perturbed copy, the trainer-side recompute.
- ``servers``: the embedded inference server in this process (``running``) or as a subprocess.
- ``openai_http``: JSON posts, streamed events and chat prompt ids against ``/generate`` and ``/v1``.
- ``fakes``: a fake HTTP server answering with recorded SGLang shapes; fake weight-update clients.
- ``batches``: trajectories built by hand for the replay queue and the trainer step.
- ``loop``: letting an event loop run every ready callback (``settle``).
- ``jobs``: launching small end-to-end jobs through the launcher and reading what they leave.
- ``chaos``: faults in a running job: its processes, waiting on it, what its servers and queue do.
- ``procs``: this machine's processes (``/proc``): a job's descendants, which of them still run.
- ``determinism``: the undisturbed determinism runs, run once per pytest run and shared by its
  test processes, and the checks of a fault run against them.
- ``episode_envs``: ``Env`` classes of multi-turn episodes with real tools, named by dotted path.
- ``weight_groups``: the other ranks of a gloo weight-update group, at SGLang's store prefixes.
- ``protocols``: checking a class against a seam's ``Protocol``, call for call.
- ``listening``: the TCP sockets a process listens on (``/proc``).
- ``parity_reward``: a reward a random model earns half the time (named by dotted path in configs).
- ``sglang_ref``: running SGLang's own code in ``.venv-sglang``.
- ``lora_jobs``: a LoRA job on SGLang set up by the launcher and its processes, stopped before anything runs.
- ``peers``: verl's, AReaL's and TRL's own loss code from ``.peers``, for the loss parity tests.
- ``reward_forms``: reward functions of each signature, named by dotted path in reward tests.
- ``chat_templates``: a Qwen3-shaped chat template (tool results grouped, earlier reasoning dropped).

A free port: ``areal_async.devices.free_port``.

Fixtures stay in ``tests/conftest.py`` (it builds the tiny models with ``models``).
"""

import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]
