"""Per-step cost of stop-string matching (``StopStrings.match``), the check the engine runs for each
request after each committed token.

Replays the tokens of GSM8K answers one at a time, as commit appends them, and times ``match`` on
the output so far (the cost grows with the decoded window, not with the output's length). Prints
microseconds of CPU time per step (process time, so other load on a shared CPU counts less), the
fastest of ``--repeats``, for a few sets of stop strings.

    python tools/bench_stop.py --tokenizer DIR [--steps 20000]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

from transformers import AutoTokenizer

from areal_async.embedded.engine.stop import StopStrings

REPO = pathlib.Path(__file__).resolve().parents[1]
CASES = {
    "1 stop, '</tool>'": ("</tool>",),
    "2 stops, '</tool_call>' '\\n\\nUser:'": ("</tool_call>", "\n\nUser:"),
    "4 stops, up to 24 bytes": ("</tool_call>", "\n\nUser:", "The final answer is", "<|im_end|> never said"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a directory with an HF tokenizer")
    parser.add_argument("--steps", type=int, default=20000, help="committed tokens to replay per case")
    parser.add_argument("--repeats", type=int, default=7, help="timings per case; the fastest is printed")
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    lines = (REPO / "data/gsm8k/train.jsonl").read_text().splitlines()
    stream: list[int] = []
    for line in lines:  # answers only (no stop string occurs in them), until there are enough tokens
        stream += tok.encode(json.loads(line)["answer"], add_special_tokens=False)
        if len(stream) >= args.steps:
            break
    stream = stream[: args.steps]
    print(f"{'stop strings':<40} {'window':>6} {'us/step':>8}")
    for name, strings in CASES.items():
        stops = StopStrings(strings, tok)
        best = float("inf")
        for _ in range(args.repeats):
            out: list[int] = []
            t0 = time.process_time()
            for token in stream:
                out.append(token)
                assert stops.match(out) is None
            best = min(best, time.process_time() - t0)
        print(f"{name:<40} {stops.window:>6} {best / len(stream) * 1e6:>8.2f}")


if __name__ == "__main__":
    main()
