"""``tools/cpu_by_process.py``: CPU time of a command's process tree, by kind of process."""

import importlib.util
import subprocess
import sys

import pytest

from tests.support import REPO

_spec = importlib.util.spec_from_file_location("cpu_by_process", REPO / "tools" / "cpu_by_process.py")
cpu_by_process = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cpu_by_process)


@pytest.mark.parametrize("argv, kind", [
    (["/venv/bin/python", "-u", "-m", "areal_async.trainer.main", "--config", "c.yaml"], "areal_async.trainer.main"),
    (["/usr/bin/python3", "/x/ray/_private/workers/default_worker.py", "--node-ip-address=1"], "default_worker.py"),
    (["/venv/bin/python", "-c", "print(1)"], "python -c"),
    (["/usr/bin/raylet", "--node_ip_address=1"], "raylet"),
    ([], "?"),
])
def test_the_kind_of_a_process(argv, kind):
    assert cpu_by_process.kind_of(argv) == kind


def test_a_grandchild_that_burns_a_second_is_counted_under_its_script(tmp_path):
    burn = tmp_path / "burn.py"
    burn.write_text("import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0:\n    pass\n")
    # the command starts a child, which starts burn.py and waits: found through the tree
    run_burn = f"import subprocess, sys; subprocess.run([sys.executable, {str(burn)!r}], check=True)"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {run_burn!r}], check=True)"
    out = subprocess.run([sys.executable, str(REPO / "tools/cpu_by_process.py"), "--interval-s", "0.05", "--",
                          sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[-1]: line.split() for line in out.stderr.splitlines()[2:]}
    cpu_s, procs = float(rows["burn.py"][0]), int(rows["burn.py"][1])
    assert 0.9 <= cpu_s <= 1.5 and procs == 1, out.stderr
