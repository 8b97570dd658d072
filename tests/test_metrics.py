"""The console step line (metrics.format_line)."""

from areal_async.metrics import format_line


def test_the_step_line_names_rates_for_what_they_are_and_shows_entropy_and_lr():
    line = format_line(3, 30, {"rollout/correct": 0.5, "train/loss": -0.01, "train/entropy": 0.1234,
                               "train/lr": 2e-5, "perf/trained_tokens_per_s": 812.4,
                               "rollout/tokens_per_s": 4.2, "perf/step_s": 150.0, "train/tokens": 7400.0})
    assert line == ("step    3/30 | correct 0.50 | loss -0.0100 | entropy 0.123 | lr 2.00e-05 | "
                    "train 812 tok/s | rollout 4 tok/step-s | 150.0 s")
    assert format_line(30, 30, {"eval/pass@1": 0.25, "train/entropy": float("nan")}) == \
        "step   30/30 | eval pass@1 0.250"
