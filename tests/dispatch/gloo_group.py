"""Spawn a gloo process group of worker scripts on the CPU and collect each rank's results (the expert-parallel
tests' harness: tests/dispatch/test_ep_cpu.py, test_ep_batch_invariant.py)."""
import json
import os
import subprocess
import sys


def run_group(script: str, lead: list[str], world: int, tmp_dir: str, deadline_s: float) -> list[dict]:
    """Run ``python script *lead RANK WORLD INIT TMP_DIR`` for each rank at once (a file rendezvous in tmp_dir); each
    worker writes TMP_DIR/rank<R>.json. -> each rank's dict from it ({} if none) with its output's tail under "_log".
    Every worker is killed once one outlives ``deadline_s``, so a hung collective cannot hang the suite."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
           "OMP_NUM_THREADS": "1", "MOEFLOW_DIST_TIMEOUT_S": "60"}
    init = os.path.join(tmp_dir, "rendezvous")
    procs = [subprocess.Popen([sys.executable, script, *lead, str(r), str(world), init, tmp_dir], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=deadline_s)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs.append("killed after the deadline")
    results = []
    for r in range(world):
        path = os.path.join(tmp_dir, f"rank{r}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else {})
        results[-1]["_log"] = logs[r][-3000:] if r < len(logs) else ""
    return results
