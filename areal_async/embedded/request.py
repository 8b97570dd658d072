"""Decoding of request bodies with SGLang 0.5.23's meaning: ``sampling_params`` and ``/generate``.

As SGLang's contract decoder (docs/sglang_api.md#generation): exact JSON types, ``null`` = absent,
unknown top-level keys ignored, unknown ``sampling_params`` keys refused. Top-level fields go
through ``fields.field``; ``sampling_params`` through msgspec's strict decoding into
``_WireSampling`` (the schema, one line per SGLang field; ``_wire_error`` makes its errors name the
value and the fix), then onto ``SamplingParams`` with SGLang's normalisation. A field the engine
does not implement is refused at a non-neutral value (``choice`` at any value). Every error is a
``ValueError`` naming the field, the value and what to send.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import msgspec

from .fields import field, per_prompt, rids
from .engine.sampling import GREEDY_BELOW, SamplingParams

# ---- sampling_params ----------------------------------------------------------------------------

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k (its default); -1 means the same
MAX_STOP_STRINGS = 32  # SGLang's MAX_STOP_COUNT


class _WireSampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``sampling_params`` as SGLang 0.5.23's schema types it (``api_types.SamplingParams``);
    ``None`` is "absent" for every field (SGLang's decoder maps ``null`` to the default)."""

    max_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    custom_params: Any = None
    beam_width: int | None = None
    watermark: dict[str, Any] | None = None
    choice: list[str] | None = None


# fields the engine runs only at their neutral value: (is it neutral?, what to send)
_NEUTRAL = {
    "min_p": (lambda v: v == 0.0, "0"),
    "frequency_penalty": (lambda v: v == 0.0, "0"),
    "presence_penalty": (lambda v: v == 0.0, "0"),
    "repetition_penalty": (lambda v: v == 1.0, "1"),
    "n": (lambda v: v == 1, "1 (send one request per sample, each with its own sampling_seed)"),
    "json_schema": (lambda v: not v, "null"),
    "regex": (lambda v: not v, "null"),
    "ebnf": (lambda v: not v, "null"),
    "structural_tag": (lambda v: not v, "null"),
    "stop_regex": (lambda v: not v, "null or [] (stop strings are supported: use stop)"),
    "logit_bias": (lambda v: not v, "null or {}"),
    "beam_width": (lambda v: v == 1, "null"),
    "watermark": (lambda v: not v or v.get("enabled") is False, "null"),
}
# fields accepted and without effect here: stream_interval (no streaming in this decoder) and
# custom_params (read only by a custom logit processor, which this server does not run)
_WITHOUT_EFFECT = ("stream_interval", "custom_params")

_SEND = {  # what to send, by the JSON type msgspec expected first
    "int": "an integer, unquoted (SGLang's schema takes no numeric strings)",
    "float": "a number, unquoted (SGLang's schema takes no numeric strings)",
    "bool": "true or false (not a string or a number)",
    "str": "a string",
    "array": "a list",
    "object": "a JSON object",
}
_PATH = re.compile(r"\s*-\s*at\s*`\$(?:\.(\w+))?.*`$")


def _wire_error(exc: msgspec.ValidationError, raw: dict) -> ValueError:
    """msgspec's decode error as this project's: the field, its value, the rule, what to send."""
    text = str(exc)
    unknown = re.match(r"Object contains unknown field `(.*)`", text)
    if unknown:
        known = [f.name for f in msgspec.structs.fields(_WireSampling)]
        return ValueError(f"unknown sampling_params field '{unknown.group(1)}'; SGLang's sampling_params "
                          f"fields are {known}")
    path = _PATH.search(text)
    key = path.group(1) if path else None
    rule = _PATH.sub("", text)
    if key is None:
        return ValueError(f"sampling_params: {rule}")
    expected = re.match(r"Expected `([^`]*)`", rule)
    kinds = [k for k in re.findall(r"\w+", expected.group(1)) if k != "null"] if expected else []
    send = " or ".join(_SEND.get(k, k) for k in kinds) or "a value of the JSON type SGLang's schema gives it"
    return ValueError(f"sampling_params.{key} {raw.get(key)!r} has the wrong JSON type ({rule}); send {send}")


def decode_sampling(raw: dict | None, max_new_tokens_if_null: int | None = None) -> SamplingParams:
    """A JSON ``sampling_params`` object as ``SamplingParams``, with SGLang's meaning.

    Args:
        raw: the decoded JSON object (``None``: all defaults).
        max_new_tokens_if_null: what ``"max_new_tokens": null`` means (SGLang: the rest of the
            context, ``--max-seq-len`` minus the prompt); ``None``: SGLang's default 128.

    Raises:
        ValueError: not an object, an unknown field, a value of the wrong JSON type, a
            non-neutral value of a field the engine does not implement, or an out-of-range value
            (SGLang's ``verify`` ranges); the message names the field and what to send.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"'sampling_params' {raw!r} must be a JSON object, e.g. {{\"max_new_tokens\": 16}}")
    try:
        wire = msgspec.convert(raw, _WireSampling)
    except msgspec.ValidationError as exc:
        raise _wire_error(exc, raw) from None
    if "choice" in raw:  # in SGLang's schema, but its Python server's SamplingParams has no such field
        raise ValueError("sampling_params.choice is not supported (SGLang's Python server refuses it as well); "
                         "leave it out")
    for key, (neutral, send) in _NEUTRAL.items():
        value = getattr(wire, key)
        if value is not None and not neutral(value):
            raise ValueError(f"sampling_params.{key}={value!r} is not supported by this server; send {send}")
    max_new = wire.max_new_tokens if wire.max_new_tokens is not None else (
        128 if "max_new_tokens" not in raw or max_new_tokens_if_null is None else max_new_tokens_if_null)
    temperature = 1.0 if wire.temperature is None else wire.temperature
    top_p = 1.0 if wire.top_p is None else wire.top_p
    top_k = -1 if wire.top_k in (None, -1) or wire.top_k >= TOP_K_ALL else wire.top_k
    min_new = wire.min_new_tokens or 0
    stop = [wire.stop] if isinstance(wire.stop, str) else list(wire.stop or [])
    if max_new < 0:
        raise ValueError(f"sampling_params.max_new_tokens {max_new} is negative; send 0 (prefill only: the "
                         f"prompt's log-probs, no token) or more")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"sampling_params.temperature {temperature} is not a finite number >= 0; send 0 "
                         f"(greedy) or a positive temperature")
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"sampling_params.top_p {top_p} is not in (0, 1]; send 1 for the whole distribution")
    if top_k < 1 and top_k != -1:
        raise ValueError(f"sampling_params.top_k {top_k} is not -1 (the whole vocabulary) or >= 1")
    if not 0 <= min_new <= max_new:
        raise ValueError(f"sampling_params.min_new_tokens {min_new} is not in [0, max_new_tokens ({max_new})]; "
                         f"send at most max_new_tokens")
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"sampling_params.stop has {len(stop)} strings; SGLang allows at most "
                         f"{MAX_STOP_STRINGS}: send fewer")
    if "" in stop:
        raise ValueError("sampling_params.stop has an empty string, which would match before any text; "
                         "send non-empty stop strings")
    seed = wire.sampling_seed
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise ValueError(f"sampling_params.sampling_seed {seed} is not a 64-bit signed integer; send one in "
                         f"[-2**63, 2**63)")
    if temperature < GREEDY_BELOW:  # logits / T would overflow: greedy, as SGLang does
        temperature = 0.0
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=tuple(stop),
        stop_token_ids=sorted(set(wire.stop_token_ids or ())),
        min_new_tokens=min_new,
        ignore_eos=bool(wire.ignore_eos),
        no_stop_trim=bool(wire.no_stop_trim),
        sampling_seed=seed,
        skip_special_tokens=wire.skip_special_tokens is not False,
        spaces_between_special_tokens=wire.spaces_between_special_tokens is not False,
    )


# ---- /generate ----------------------------------------------------------------------------------


class Prompt(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt of a ``/generate`` call, decoded: its tokens, request id, sampling parameters and
    log-prob options. ``logprob_start_len`` ``-1``: log-probs of output tokens only; ``k >= 0``
    (with ``return_logprob``): also ``meta_info.input_token_logprobs`` for prompt positions
    ``k ..``, as SGLang returns them."""

    input_ids: list[int]
    rid: str
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1


class GenerateCall(msgspec.Struct, frozen=True, kw_only=True):
    """A decoded ``/generate`` body: its prompts (one, or a batch), whether it was a batch (the
    answer is then a list), ``stream`` and ``return_text_in_logprobs`` (each log-prob entry's third
    element is then the token's text, else ``null``)."""

    prompts: list[Prompt]
    batch: bool
    stream: bool = False
    return_text_in_logprobs: bool = False


def parse_generate(body: dict, max_seq_len: int, tokenize: Callable[[str | list[str]], list],
                   validate: Callable[[list[int], SamplingParams, str], None]) -> GenerateCall:
    """A ``/generate`` body decoded with SGLang's meaning: its prompts (token ids, rid, sampling
    params, log-prob options), whether it is a batch, ``stream`` and ``return_text_in_logprobs``.

    Args:
        body: the decoded JSON object.
        max_seq_len: the engine's context length (what ``max_new_tokens: null`` fills).
        tokenize: ``text`` (one prompt, or a list for a batch) → token ids (a list, or a list of lists).
        validate: raises ``ValueError`` for a prompt the engine cannot run (``Engine.validate``).

    Raises:
        ValueError: naming the field that is wrong, its value and what to send.
    """
    stream = field(body, "stream", "bool", False)
    text_in_logprobs = field(body, "return_text_in_logprobs", "bool", False)
    refuse_unsupported(body)
    ids = body.get("input_ids")
    if ids is not None and body.get("text") is not None:  # SGLang refuses both as well
        raise ValueError("send either 'input_ids' or 'text', not both")
    if ids is None and body.get("text") is not None:
        ids = tokenize(field(body, "text", "text"))
    if not isinstance(ids, list):
        raise ValueError("send 'input_ids' (a list of token ids, or a list of such lists) or 'text'")
    batch = bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    if not all(isinstance(p, list) and all(type(t) is int for t in p) for p in prompts):
        raise ValueError("'input_ids' must be a list of integer token ids, or a list of such lists")
    n = len(prompts)
    logprob = per_prompt(body, "return_logprob", "bool", False, n, batch)
    start = per_prompt(body, "logprob_start_len", "int", -1, n, batch)
    request_ids = rids(body.get("rid"), n, batch)
    raw = body.get("sampling_params")
    if batch and isinstance(raw, list):  # SGLang: one object for all, or one per prompt
        if len(raw) != n:
            raise ValueError(f"sampling_params has {len(raw)} objects for a batch of {n} prompts; send "
                             f"one object for all, or one per prompt")
    elif isinstance(raw, list):
        raise ValueError("'sampling_params' must be a JSON object for one prompt, e.g. {\"max_new_tokens\": 16}")
    else:
        raw = [raw] * n
    out = []
    for prompt, rid, sampling, lp, st in zip(prompts, request_ids, raw, logprob, start):
        # max_new_tokens: null is "the rest of the context" (SGLang's)
        params = decode_sampling(sampling, max(max_seq_len - len(prompt), 0))
        if st < -1:
            raise ValueError(f"logprob_start_len {st} is not -1 (output tokens only) or a prompt position >= 0")
        if lp and st >= len(prompt):
            raise ValueError(f"logprob_start_len {st} is not below the prompt's {len(prompt)} tokens; send -1 "
                             f"(output tokens only) or a position in [0, {len(prompt)})")
        validate(prompt, params, rid)
        out.append(Prompt(input_ids=prompt, rid=rid, params=params, return_logprob=lp, logprob_start_len=st))
    return GenerateCall(prompts=out, batch=batch, stream=stream, return_text_in_logprobs=text_in_logprobs)


def refuse_unsupported(body: dict) -> None:
    """Raise ``ValueError`` for a top-level ``/generate`` field SGLang honours and this server does
    not (at a non-neutral value): ``top_logprobs_num > 0``, ``token_ids_logprob``,
    ``return_hidden_states``, ``input_embeds``, multimodal data, ``session_params``. ``lora_path``
    is checked by ``check_lora_path``."""
    top = body.get("top_logprobs_num")
    if any(v not in (None, 0) for v in (top if isinstance(top, list) else [top])):
        raise ValueError(f"top_logprobs_num {top!r} is not supported by this server (only the chosen "
                         f"token's log-prob is returned); send 0 or leave it out")
    for key in ("token_ids_logprob", "input_embeds", "image_data", "video_data", "audio_data",
                "session_params", "custom_logit_processor"):
        if body.get(key) not in (None, [], {}):
            raise ValueError(f"{key} is not supported by this server; leave it out")
    hidden = body.get("return_hidden_states")
    if any(v not in (None, False) for v in (hidden if isinstance(hidden, list) else [hidden])):
        raise ValueError("return_hidden_states is not supported by this server; send false or leave it out")


def check_lora_path(body: dict, adapter_name: str | None) -> None:
    """Raise ``ValueError`` unless ``lora_path`` (SGLang's adapter name, one or one per prompt) is
    absent or names the LoRA adapter this server holds, ``adapter_name``. The adapter is merged
    into the weights, so every request is served by it, named or not (docs/lora_sync.md)."""
    raw = body.get("lora_path")
    names = raw if isinstance(raw, list) else [raw]
    for name in names:
        if name is None:
            continue
        if not isinstance(name, str):
            raise ValueError(f"lora_path {raw!r} is not an adapter name (a string, or a list of them)")
        if name != adapter_name:
            loaded = f"'{adapter_name}'" if adapter_name is not None else "none"
            raise ValueError(f"lora_path '{name}' is not a loaded LoRA adapter (loaded: {loaded}); load it with "
                             f"/load_lora_adapter first, or leave lora_path out")
