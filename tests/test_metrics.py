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


def test_wandb_group_and_tags_come_from_the_logging_config(tmp_path, monkeypatch):
    # a staleness study's cells share one group (the study) and carry eta/objective/seed tags
    import wandb

    from areal_async.config import LoggingConfig
    from areal_async.metrics import MetricsLogger

    calls = []

    class Run:
        def finish(self):
            pass

    monkeypatch.setattr(wandb, "init", lambda **kwargs: calls.append(kwargs) or Run())
    tags = ["eta=2", "objective=naive", "seed=1"]
    MetricsLogger(tmp_path / "a", LoggingConfig(wandb_group="study", wandb_tags=tags), "eta2-naive-s1", {}).close()
    MetricsLogger(tmp_path / "b", LoggingConfig(), "plain", {}).close()
    assert (calls[0]["group"], calls[0]["name"], calls[0]["tags"]) == ("study", "eta2-naive-s1", tags)
    assert (calls[1]["group"], calls[1]["tags"]) == ("plain", [])  # default: grouped by the run's name
