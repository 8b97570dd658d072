"""Resume in deterministic mode: a run stopped after step 3 and resumed from its checkpoint ends
at step 6 with the same metrics, trajectories and weights as an unbroken 6-step run.

What makes it exact: the checkpoint holds the fp32 weights, the full AdamW state and the RNG
(``trainer/resume.py``) and the groups the queue had finished but not yet handed out (taken after
``wait_drained``, so they are exactly the groups of versions ≤ 3 not yet trained); the servers
restart with the checkpoint's weights as version 3 and the queue at version 3 with that buffer.
Data order and sampling seeds are functions of (run seed, group id) and need no state.
"""

import pytest

from tests.test_determinism import fingerprint, run_job


@pytest.mark.slow
def test_resumed_run_matches_unbroken_run(tiny_model_dir, tmp_path):
    unbroken = fingerprint(run_job(tiny_model_dir, tmp_path, "unbroken", "deterministic", 1, steps=6))
    run_job(tiny_model_dir, tmp_path, "resumed", "deterministic", 2, steps=3)
    resumed = fingerprint(run_job(tiny_model_dir, tmp_path, "resumed", "deterministic", 3, steps=6, resume=True))
    print(f"\nweights sha256: unbroken {unbroken['weights']} / resumed {resumed['weights']}")
    assert [r["step"] for r in resumed["metrics"]] == list(range(6))
    assert resumed["metrics"] == unbroken["metrics"]
    assert resumed["trajectories"] == unbroken["trajectories"]
    assert resumed["weights"] == unbroken["weights"]
