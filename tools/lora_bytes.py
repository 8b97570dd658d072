"""Bytes one weight update sends: a LoRA adapter vs the full model, on Qwen3 shapes (meta device).

Full weights go out in the model dtype (bfloat16), every parameter once (a tied head once); the
adapter in ``lora_sync``'s send dtype, float32 by default, bfloat16 when set to the servers' dtype
(both columns), rank ``r`` on every linear of every layer (q, k, v, o, gate, up, down) or on the
attention projections only. Nothing is allocated: the models are built on the meta device
(``lora_sync.update_bytes``). Qwen3-0.6B's shape is ``tools/qwen3_shapes.py``'s; Qwen3-8B's is its
public config (hidden 4096, intermediate 12288, 36 layers, 32 heads, 8 KV heads, head_dim 128,
vocab 151936, untied head).

    python tools/lora_bytes.py [--ranks 8 32]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from areal_async.trainer.lora_sync import ALL_LINEAR, update_bytes  # noqa: E402

QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)


def configs() -> dict:
    from transformers import Qwen3Config

    sys.path.insert(0, str(REPO / "tools"))
    from qwen3_shapes import SHAPES

    return {"Qwen3-0.6B": Qwen3Config(**SHAPES["0.6b"], tie_word_embeddings=True),
            "Qwen3-8B": Qwen3Config(**QWEN3_8B)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()
    mib = 2**20
    targets = {"all linear": ALL_LINEAR, "attention (q,k,v,o)": ALL_LINEAR[:4]}
    print("| model | targets | rank | adapter params | adapter MiB fp32 / bf16 | full params | full MiB (bf16) "
          "| full / adapter, fp32 adapter | full / adapter, bf16 adapter |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, cfg in configs().items():
        for label, modules in targets.items():
            for r in args.ranks:
                s = update_bytes(cfg, r, modules, adapter_dtype=torch.float32, full_dtype=torch.bfloat16)
                half = s["adapter"] / 2
                print(f"| {name} | {label} | {r} | {s['adapter_params']:,} | {s['adapter'] / mib:.1f} / {half / mib:.1f} "
                      f"| {s['full_params']:,} | {s['full'] / mib:.0f} | {s['ratio']:.0f}x | {s['full'] / half:.0f}x |")


if __name__ == "__main__":
    main()
