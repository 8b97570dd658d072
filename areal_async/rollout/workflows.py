"""Workflows: what an episode does between its model turns. One seam, three shapes.

- ``ToolLoop`` (the default): one answer, or, with ``rollout.tools``, a tool loop on stop strings
  (a call ends at its end tag, its result is the next observation, generation continues), scored
  by the task's reward function. With no tools it is the single-turn math rollout.
- ``EnvWorkflow``: a token-level ``Env`` (``reset(item, seed)``, ``step(action)``), as Tinker and
  SkyRL-gym define one.
- ``OpenAIWorkflow``: ``async def run(item, client)`` against a stock ``openai.AsyncOpenAI``
  (``openai_endpoint.py`` records each call).

``rollout.workflow: package.module:object`` names the user's object; ``load_workflow`` reads its
shape. How to write one: docs/workflows.md.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import numpy as np

from areal_async.rollout import observations
from areal_async.rollout.env_errors import EnvErrors, EnvFailed, OnEnvError, Throttle
from areal_async.rollout.env_limit import EnvTimeout, call_env
from areal_async.rollout.episode import Episode, EpisodeTruncated
from areal_async.types import Sample


class EpisodeItem(msgspec.Struct, frozen=True):
    """What a workflow gets of the group's item.

    Fields:
        messages: the chat turns of the group's prompt (system turn, demonstrations and
            instruction included): a first call with exactly these starts from the group's
            prompt tokens, shared by the group.
        answer: the gold answer (``""``: none).
        row: the item's row as read (every field).
        data_index: the item's index in the task; source: where its row came from.
    """

    messages: list[dict[str, Any]]
    answer: str
    row: dict[str, Any] = {}
    data_index: int = 0
    source: str = ""


class Action(msgspec.Struct, frozen=True):
    """A model turn as an ``Env`` sees it: ``text`` (decoded for reading), ``ids`` (the sampled
    token ids), ``finish_reason`` (``stop`` | ``length``), ``turn`` (t, from 0) and ``seed`` (the
    turn's seed: a stochastic environment draws from it, never from a clock)."""

    text: str
    ids: list[int]
    finish_reason: str
    turn: int
    seed: int


class Env(Protocol):
    """A token-level environment, one instance per episode (``rollout.workflow`` names its class,
    called with no arguments). Either method may be ``async``. Observations: a list of chat
    messages (rendered by the chat template after the model's turn), a list of token ids (appended
    verbatim) or ``None`` (nothing; ``observations.py``). ``stop``, if present: a stop string or a
    list of them, for every model turn."""

    def reset(self, item: EpisodeItem, seed: int) -> list[dict[str, Any]] | list[int] | None:
        """The first observation; ``None``: the item's messages (the group's prompt)."""

    def step(self, action: Action) -> tuple[Any, float, bool] | tuple[Any, float, bool, dict]:
        """``(observation, reward, done)`` after a model turn, optionally with an info dict
        (``correct``: bool; ``tool_calls``, ``tool_errors``: counts)."""


Workflow = Callable[[Episode, EpisodeItem], Any]
"""``await workflow(episode, item) -> Sample``."""


class ToolLoop:
    """The default workflow: answer, calling ``tools`` until an answer without a call (at most
    ``episode.max_turns`` turns; a call left unanswered marks the episode truncated), then score
    the last turn's text with ``reward_fn`` (``RewardPool.score``: ``messages`` are the episode's
    turns before it).

    Args:
        rewards: the reward pool; reward_fn: the task's reward name or function.
        tools: a ``ToolSet`` or ``None`` (one model turn, no stop strings: the single-turn rollout).
    """

    def __init__(self, rewards, reward_fn, tools=None):
        self.rewards, self.reward_fn, self.tools = rewards, reward_fn, tools

    async def __call__(self, ep: Episode, item: EpisodeItem) -> Sample:
        conv = ep.start()
        stop = list(self.tools.stop_strings) if self.tools else []
        while True:
            try:
                turn = await ep.generate(stop=stop)
            except EpisodeTruncated:
                break
            call = self.tools.parse(turn.text) if self.tools and turn.finish_reason == "stop" else None
            if call is None:
                break
            if len(ep.turns) >= ep.max_turns:  # its result would have no turn to read it
                ep.stats["truncated"] = True
                break
            with ep.timed_env():
                result = await self.tools.run(call, seed=turn.seed)
            ep.stats["tool_calls"] += 1
            ep.stats["tool_errors"] += result.error is not None
            conv.add_messages([result.message()])
        last = ep.turns[-1].text if ep.turns else ""
        score = await self.rewards.score(self.reward_fn, last, item.answer, prompt=conv.messages[:-1],
                                         item=item.row)
        return ep.to_sample(score.reward, score.correct, score.error)


class EnvWorkflow:
    """Episodes of an ``Env`` class: reset, then model turn and ``step`` until ``done`` or a
    limit. Rewards are per turn (``Sample.turn_rewards``; the episode's own reward is 0);
    ``correct``: the last info's, else whether the rewards sum above 0. ``env_timeout_s``: each
    call's wall-clock limit, the constructor's, ``reset``'s and each ``step``'s (0: none;
    ``env_limit.call_env``). ``on_env_error``: ``zero`` ends an episode whose call failed there (a
    failed constructor or ``reset``: no turn; a failed ``step``: that turn's reward 0), ``correct``
    False (``env_errors.py``). ``vocab_size``: observation ids must be below it (0:
    ``len(tokenizer)``). A first observation that fills ``max_seq_len`` leaves the episode with no
    turn; that is printed (the first, then at most one a minute).

    Raises (from a call): under ``on_env_error: raise``, what the constructor, ``reset`` or
    ``step`` raise, with the episode and turn named, and ``EnvTimeout`` for an ``async`` call past
    the limit (a synchronous one ends the process); under either, ``TypeError``/``ValueError`` for
    a ``stop`` that is no string or list of strings, a malformed step result or observation
    (``observations.py``), or a reward that is no finite number.
    """

    def __init__(self, env_class: Callable[[], Env], env_timeout_s: float = 0.0, on_env_error: OnEnvError = "raise",
                 vocab_size: int = 0):
        self.env_class, self.env_timeout_s, self.vocab_size = env_class, env_timeout_s, vocab_size
        self.errors = EnvErrors(on_env_error)
        self._full = Throttle()  # first observations that filled the context

    async def __call__(self, ep: Episode, item: EpisodeItem) -> Sample:
        name, where = _name(self.env_class), f"episode {ep.name}"
        vocab = self._vocab(ep)
        try:
            env = await self._call(ep, self.env_class, (), f"{name}.__init__", where)
            first = await self._call(ep, env.reset, (item, ep.seed), f"{name}.reset", where)
        except EnvFailed:
            ep.start()  # no turn: an empty episode
            return ep.to_sample(0.0, False, turn_rewards=[])
        conv = ep.start(*observations.first(first, vocab, f"{name}.reset", where))
        stop = _stop_strings(getattr(env, "stop", None), name)
        rewards: list[float] = []
        info: dict = {}
        while True:
            try:
                turn = await ep.generate(stop=stop)
            except EpisodeTruncated:
                if not ep.turns and ep.max_seq_len and len(conv.ids) >= ep.max_seq_len:
                    self._report_full(ep, name, len(conv.ids))
                break
            action = Action(turn.text, turn.ids, turn.finish_reason, turn.index, turn.seed)
            at = f"{where}, turn {turn.index}"
            try:
                out = await self._call(ep, env.step, (action,), f"{name}.step", at)
            except EnvFailed:
                rewards.append(0.0)  # the turn whose step failed
                break
            observation, reward, done, info = _step_result(out, f"{name}.step", at)
            rewards.append(_reward(reward, f"{name}.step", at))
            ep.stats["tool_calls"] += int(info.get("tool_calls", 0))
            ep.stats["tool_errors"] += int(info.get("tool_errors", 0))
            if done:
                break
            observations.extend(conv, observation, vocab, f"{name}.step", at)
        correct = not ep.stats["env_error"] and (bool(info["correct"]) if "correct" in info else sum(rewards) > 0)
        return ep.to_sample(0.0, correct, turn_rewards=rewards)

    def _report_full(self, ep: Episode, name: str, n: int) -> None:
        """Print (throttled) that a first observation of ``n`` tokens left no room for a turn."""
        if self._full.due():
            print(f"[env] {name}.reset's first observation fills the context in episode {ep.name}: {n} tokens "
                  f"of inference.max_seq_len={ep.max_seq_len}, so the episode has no turn (an empty episode, its "
                  f"return in no statistics; counted in rollout/truncated and rollout/empty_episodes); shorten "
                  f"the observation or raise inference.max_seq_len; "
                  f"{self._full.count} so far in this worker, at most one printed a minute", flush=True)

    def _vocab(self, ep: Episode) -> Callable[[], int]:
        """The bound of observation ids, asked only of ids (``len`` of a slow tokenizer builds its
        vocabulary)."""
        return lambda: self.vocab_size or len(ep.tokenizer)

    async def _call(self, ep: Episode, fn, args: tuple, what: str, where: str):
        """``fn(*args)`` within the limit, its time counted as the environment's. Raises what
        ``EnvErrors.fail`` raises for a failure."""
        try:
            with ep.timed_env():
                return await call_env(fn, args, what, where, self.env_timeout_s)
        except Exception as exc:
            self.errors.fail(exc, what, where, ep.stats)


class OpenAIWorkflow:
    """Episodes of ``async def run(item, client)``: ``client`` is an ``openai.AsyncOpenAI`` whose
    ``chat.completions.create`` is recorded (``openai_endpoint.py``). ``run`` returns the episode's
    reward (a number) or per-turn rewards (``{turn: reward}``, turns counted from 0 in call order;
    missing turns 0; a reward: any finite real, numpy and 0-d torch scalars too, not a bool);
    ``correct``: whether the rewards sum above 0 and a model turn was made. An episode with no model
    turn (``Sample.empty``) is printed (the first, then at most one a minute). A call past ``max_turns``, ``max_episode_tokens``
    or the context is refused (answered 400) and marks the episode truncated; if ``run`` raises
    after a refusal, the episode ends there with reward 0. Any other exception is ``run``'s
    failure (``on_env_error``), also after a turn that a limit cut short (answered 200).
    ``env_timeout_s``: the limit of the whole ``run``'s own time, the wall time less that with one
    of its model calls in flight (0: none). ``on_env_error``: ``zero`` ends an episode whose ``run`` raised or timed out with
    reward 0, ``correct`` False (``env_errors.py``). ``stated``: the run's ``(temperature, top_p)``,
    which a call may state where ``temperature``/``top_p`` differ (a greedy evaluation).

    Raises (from a call): ``TypeError`` for another return value; under ``on_env_error: raise``,
    what ``run`` raises, with the episode named, and ``EnvTimeout`` for a ``run`` past the limit;
    under either, a generation's failure in one of ``run``'s calls (the client's error, as is),
    also when ``run`` caught it.
    """

    def __init__(self, fn: Callable[..., Any], temperature: float, top_p: float, env_timeout_s: float = 0.0,
                 on_env_error: OnEnvError = "raise", stated: tuple[float, float] | None = None):
        self.fn, self.temperature, self.top_p, self.env_timeout_s = fn, temperature, top_p, env_timeout_s
        self.stated = stated
        self.errors = EnvErrors(on_env_error)
        self._empty = Throttle()  # episodes with no model turn

    async def __call__(self, ep: Episode, item: EpisodeItem) -> Sample:
        from areal_async.rollout.openai_endpoint import RecordingEndpoint

        where = f"episode {ep.name}"
        endpoint = RecordingEndpoint(ep, self.temperature, self.top_p, self.stated)
        try:
            try:
                async with endpoint.client() as client:
                    result = await call_env(self.fn, (item, client), f"{_name(self.fn)}(item, client)", where,
                                            self.env_timeout_s, endpoint.model_clock)
            except EnvTimeout as exc:
                self.errors.fail(exc, _name(self.fn), where, ep.stats)
            except Exception as exc:
                _raise_generation_failure(endpoint)
                if not endpoint.refusals:
                    self.errors.fail(exc, _name(self.fn), where, ep.stats)
                result = 0.0  # a call past a limit was refused and the agent gave up: reward 0
        except EnvFailed:
            result = 0.0
        _raise_generation_failure(endpoint)  # also when run caught it and returned
        if not ep.conversations:
            ep.start()  # no call: an empty episode
        sample = self._per_turn(ep, result, where) if isinstance(result, dict) else self._total(ep, result, where)
        if sample.empty():
            self._report_empty(ep, endpoint.refusals, sample.episode_return())
        return sample

    def _total(self, ep: Episode, result, where: str) -> Sample:
        """The sample of a reward for the whole episode (``correct``: above 0, and a model turn made)."""
        try:
            reward = _reward(result, _name(self.fn), where)
        except TypeError:
            raise TypeError(f"{_name(self.fn)} returned {result!r:.100} ({type(result).__name__}) in {where}; "
                            f"return the episode's reward (a number) or {{turn: reward}}") from None
        return ep.to_sample(reward, reward > 0 and bool(ep.turns))

    def _report_empty(self, ep: Episode, refusals: int, reward: float) -> None:
        """Print (throttled) that ``run`` ended an episode with no model turn and this reward."""
        if self._empty.due():
            why = "each of its calls was refused for a limit" if refusals else "it made no call"
            print(f"[agent] {_name(self.fn)} ended episode {ep.name} with no model turn ({why}) and the reward "
                  f"{reward:g}: an empty episode, not trained, its return in no statistics (counted in "
                  f"rollout/empty_episodes); {self._empty.count} so far in this worker, at most one printed a "
                  f"minute", flush=True)

    def _per_turn(self, ep: Episode, result: dict, where: str) -> Sample:
        """The sample of ``{turn: reward}`` (an int turn of the episode's, bool refused)."""
        bad = [k for k in result
               if not isinstance(k, numbers.Integral) or isinstance(k, bool) or not 0 <= k < len(ep.turns)]
        if bad:
            raise TypeError(f"{_name(self.fn)} returned rewards for turns {bad} in {where}, which made "
                            f"{len(ep.turns)} calls (turns 0..{len(ep.turns) - 1}); key each reward by its "
                            f"turn, an int")
        rewards = {int(k): v for k, v in result.items()}
        per_turn = [_reward(rewards.get(t, 0.0), _name(self.fn), f"{where}, turn {t}") for t in range(len(ep.turns))]
        return ep.to_sample(0.0, sum(per_turn) > 0, turn_rewards=per_turn)


def _raise_generation_failure(endpoint) -> None:
    """Raise the generation failure one of ``run``'s calls met (``RecordingEndpoint.failure``), if
    any: the engine's failure fails the worker as in every workflow (its groups are replayed), under
    either ``on_env_error``."""
    if endpoint.failure is not None:
        raise endpoint.failure


def load_workflow(spec: str, temperature: float, top_p: float, env_timeout_s: float = 0.0,
                  on_env_error: OnEnvError = "raise", vocab_size: int = 0,
                  stated: tuple[float, float] | None = None) -> Workflow:
    """The user's workflow named ``package.module:object``: a class with ``reset`` and ``step``
    (an ``Env``: ``EnvWorkflow``), or an ``async def run(item, client)`` (``OpenAIWorkflow``);
    ``env_timeout_s`` (0: none), ``on_env_error``, ``vocab_size`` and ``stated`` as theirs.

    Raises:
        ValueError: not ``module:object``, not importable, of neither shape, or an ``Env`` whose
            constructor, ``reset`` or ``step`` cannot take the workflow's arguments (names the fix).
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"rollout.workflow {spec!r} is not 'package.module:object'; e.g. "
                         f"'examples.workflows.calculator_env:CalculatorEnv'")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"rollout.workflow {spec!r} cannot be imported: {exc}; the module must be on "
                         f"PYTHONPATH (the run's working directory is)") from exc
    if inspect.isclass(obj) and callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None)):
        _check_env_signatures(obj, spec)
        return EnvWorkflow(obj, env_timeout_s, on_env_error, vocab_size)
    if inspect.iscoroutinefunction(obj) and len(inspect.signature(obj).parameters) == 2:
        return OpenAIWorkflow(obj, temperature, top_p, env_timeout_s, on_env_error, stated)
    raise ValueError(f"rollout.workflow {spec!r} is {type(obj).__name__}, neither an Env class (methods "
                     f"reset(item, seed) and step(action)) nor 'async def run(item, client)'")


def _check_env_signatures(cls, spec: str) -> None:
    """That ``cls()``, ``env.reset(item, seed)`` and ``env.step(action)`` bind (a signature
    ``inspect`` cannot read passes).

    Raises:
        ValueError: naming ``spec``, the call and why it cannot bind.
    """
    calls = [(cls, (), f"{cls.__name__}()"),
             (_method(cls, "reset"), ("item", "seed"), f"{cls.__name__}.reset(item, seed)"),
             (_method(cls, "step"), ("action",), f"{cls.__name__}.step(action)")]
    for fn, args, shown in calls:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        try:
            signature.bind(*args)
        except TypeError as exc:
            raise ValueError(f"rollout.workflow {spec!r}: {shown} fails: {exc}; an Env class is called with no "
                             f"arguments, one instance per episode, then reset(item, seed) and step(action) "
                             f"(docs/workflows.md)") from None


def _method(cls, name: str):
    """``cls``'s method ``name`` as an instance would call it (bound to a stand-in ``self``)."""
    raw = inspect.getattr_static(cls, name)
    if isinstance(raw, (staticmethod, classmethod)):
        return getattr(cls, name)
    return functools.partial(raw, None) if inspect.isfunction(raw) else getattr(cls, name)


def _reward(value, source: str, where: str) -> float:
    """``value`` as a reward: a finite number (anything ``float()`` takes but text and bool: a
    numpy or 0-d torch scalar passes; NaN and ±inf are refused).

    Raises:
        TypeError / ValueError: naming ``source``, ``where`` and the value.
    """
    try:
        if isinstance(value, (str, bytes, bool)):
            raise TypeError
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{source} gave the reward {value!r} ({type(value).__name__}) in {where}; a reward is "
                        f"a number (int or float)") from None
    if not math.isfinite(value):
        raise ValueError(f"{source} gave the reward {value!r} in {where}; a reward must be finite (a NaN or "
                         f"infinite reward makes every loss of its group NaN: nothing would be trained)")
    return value


def _step_result(out, source: str, where: str) -> tuple[Any, Any, bool, dict]:
    """``(observation, reward, done, info)`` of what ``step`` returned; ``done`` a bool (a numpy
    bool or an int 0 or 1 passes), ``info``'s ``tool_calls`` and ``tool_errors`` ints >= 0.

    Raises:
        TypeError: fewer than 3 items, an info that is no dict, another ``done`` or count; naming
            ``source``, ``where`` and the value.
    """
    try:
        observation, reward, done, *rest = out
        info = dict(rest[0]) if rest and rest[0] else {}
    except (TypeError, ValueError):
        raise TypeError(f"{source} returned {out!r:.200} in {where}; return (observation, reward, done) or "
                        f"(observation, reward, done, info) with info a dict") from None
    if not (isinstance(done, (bool, np.bool_)) or (isinstance(done, numbers.Integral) and done in (0, 1))):
        raise TypeError(f"{source} returned done {done!r:.100} ({type(done).__name__}) in {where}; done is a "
                        f"bool: True ends the episode")
    for key in ("tool_calls", "tool_errors"):
        count = info.get(key, 0)
        if not isinstance(count, numbers.Integral) or count < 0:
            raise TypeError(f"{source} returned info[{key!r}] {count!r:.100} ({type(count).__name__}) in {where}; "
                            f"a count is an int >= 0")
    return observation, reward, bool(done), info


def _stop_strings(stop, name: str) -> list[str]:
    """An ``Env``'s ``stop``: ``None`` (none), a string, or a list or tuple of strings.

    Raises:
        TypeError: another value, naming the env class and the fix.
    """
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and all(isinstance(x, str) for x in stop):
        return list(stop)
    raise TypeError(f"{name}.stop is {stop!r:.100} ({type(stop).__name__}); give a stop string or a list of them, "
                    f"e.g. stop = ['</answer>']")


def _name(obj) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def build_workflow(rollout, rewards, reward_fn, greedy: bool = False, vocab_size: int = 0) -> Workflow:
    """The run's workflow: ``rollout.workflow`` loaded (``load_workflow``), else a ``ToolLoop``
    over ``rollout.tools`` scored with ``reward_fn``. ``greedy``: for evaluations (temperature 0;
    an agent's call may still state the run's temperature and top_p);
    ``vocab_size``: the model's embedding rows (0: unknown, ``len(tokenizer)``)."""
    if rollout.workflow:
        return load_workflow(rollout.workflow, 0.0 if greedy else rollout.temperature,
                             1.0 if greedy else rollout.top_p, rollout.env_timeout_s, rollout.on_env_error,
                             vocab_size, stated=(rollout.temperature, rollout.top_p))
    tools = None
    if rollout.tools:
        from areal_async.tools import ToolSet

        tools = ToolSet(list(rollout.tools), timeout_s=rollout.tool_timeout_s)
    return ToolLoop(rewards, reward_fn, tools)
