"""Prometheus metrics (issue 31): the planner and the daemon serve /metrics behind
--metrics-listen; scripts/demo.sh scrapes both after a real training run and prints the
non-zero series, whose figures are checked here against each other and against the run."""
import os
import re
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from ragshard import Client
from ragshard.cluster import LocalCluster
from ragshard.metrics import parse, scrape

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
PLANNER = os.path.join(BUILD, "server", "ragshard-planner")
DAEMON = os.path.join(BUILD, "server", "ragshardd")


def wait_line(proc, pattern, timeout=30.0):
    """The first stdout line of `proc` that matches `pattern` (the lines before it are read)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"exited with {proc.wait()} before printing {pattern!r}")
        m = re.search(pattern, line)
        if m:
            return m
    raise AssertionError(f"no line matching {pattern!r} in {timeout} s")


def series(samples, name, **labels):
    """The value of the one sample of `name` whose labels include `labels`."""
    found = [v for n, l, v in samples if n == name and all(l.get(k) == w for k, w in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_planner_creates_a_nested_data_dir_and_serves_metrics():
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "NEW", "NESTED", "DIR")
        p = subprocess.Popen([PLANNER, "--listen", "127.0.0.1:0", "--data-dir", data,
                              "--metrics-listen", "127.0.0.1:0"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            url = wait_line(p, r"metrics on (http://127\.0\.0\.1:\d+/metrics)").group(1)
            assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
            samples = scrape(url)
            assert series(samples, "ragshard_planner_jobs", state="ready") == 0
            assert series(samples, "ragshard_planner_nodes", state="up") == 0
            assert series(samples, "ragshard_planner_rank_registrations_total") == 0
            assert series(samples, "ragshard_planner_watch_streams") == 0
        finally:
            p.terminate()
            p.wait(timeout=30)


@pytest.mark.parametrize("program", ["planner", "daemon"])
def test_bad_metrics_addresses_are_named_and_leave_nothing_behind(program):
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        for bad, why in [("127.0.0.1:http", "the port must be a number"),
                         ("8.8.8.8:0", "cannot listen there")]:
            if program == "planner":
                argv = [PLANNER, "--listen", "127.0.0.1:0", "--data-dir", data]
            else:  # the daemon refuses before it reaches any planner
                argv = [DAEMON, "--planner", "127.0.0.1:1", "--node-id", "n0", "--socket",
                        os.path.join(tmp, "d.sock"), "--pool-bytes", str(1 << 20)]
            r = subprocess.run(argv + ["--metrics-listen", bad], capture_output=True, text=True,
                               timeout=60)
            assert r.returncode != 0
            assert "--metrics-listen" in r.stderr and why in r.stderr, r.stderr
            if why.startswith("the port"):
                assert not os.path.exists(data)  # checked before the data dir is made
        assert not os.path.exists(os.path.join(tmp, "d.sock"))


def test_a_nodes_ranks_register_in_one_call_through_their_daemon():
    """A 2 x 2 job: each daemon registers its node's 2 ranks with one RegisterNodeRanks, and no
    rank calls RegisterRank; ranks that do not say how many share their node go one by one."""
    inventory = {"units": [{"name": "u", "tensors": [
        {"name": "u.w", "shape": [64, 32], "dtype": "fp32"}]}]}
    with LocalCluster(BUILD, daemons=2, metrics=True) as c:
        c.attach("two-by-two", inventory, ranks=4, daemon=None)
        planner = scrape(c.metrics_urls["planner"])
        assert series(planner, "ragshard_planner_registration_calls_total", method="node") == 2
        assert series(planner, "ragshard_planner_registration_calls_total", method="rank") == 0
        assert series(planner, "ragshard_planner_rank_registrations_total") == 4
        c.attach("unsaid", inventory, ranks=2, daemon=0, local_ranks=0)
        planner = scrape(c.metrics_urls["planner"])
        assert series(planner, "ragshard_planner_registration_calls_total", method="node") == 4
        assert series(planner, "ragshard_planner_registration_calls_total", method="rank") == 0


def test_a_failed_attach_is_counted_by_its_cause():
    with LocalCluster(BUILD, daemons=1, metrics=True) as c:
        client = Client(c.planner, c.sockets[0], "no-such-job", 0, c.nodes[0], 5000)
        with pytest.raises(Exception, match="no-such-job"):
            client.attach()
        samples = scrape(c.metrics_urls[c.nodes[0]])
        assert series(samples, "ragshard_daemon_errors_total", cause="bad_request") == 1
        assert series(samples, "ragshard_daemon_jobs") == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another user")
def test_a_stranger_on_the_side_channel_is_refused_by_its_credentials():
    """The socket's mode keeps strangers out; should it be opened up (chmod), the daemon still
    checks the peer's credentials (SO_PEERCRED) before it hands out the pool's memfd."""
    with LocalCluster(BUILD, daemons=1, metrics=True) as c:
        os.chmod(c.dir, 0o711)
        os.chmod(c.sockets[0] + ".fd", 0o666)
        # The daemon may refuse and close before the probe's id arrives: its answer is still
        # there to read.
        probe = ("import socket, sys; s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1])\n"
                 "try:\n    s.sendall(b'x')\nexcept BrokenPipeError:\n    pass\n"
                 "sys.stdout.write(s.recv(4096).decode(errors='replace'))")
        # The system's interpreter (the probe needs only the standard library): the stranger
        # may not be able to reach the project's .venv (a clone in a mode-0700 folder).
        r = subprocess.run(["/usr/bin/python3", "-c", probe, c.sockets[0] + ".fd"],
                           capture_output=True, text=True, timeout=60,
                           preexec_fn=lambda: (os.setgroups([]), os.setgid(65534),
                                               os.setuid(65534)))
        assert r.returncode == 0, r.stderr
        assert "may not attach" in r.stdout and "uid 65534" in r.stdout, r.stdout
        assert "memfd" not in r.stdout
        samples = scrape(c.metrics_urls[c.nodes[0]])
        assert series(samples, "ragshard_daemon_errors_total", cause="permission_denied") == 1


def test_demo_scrapes_both_endpoints_and_prints_their_nonzero_series():
    env = dict(os.environ, DEMO_SKIP_BUILD="1", BUILD_DIR=BUILD, DEMO_STEPS="3",
               PYTHONPATH=os.path.join(BUILD, "python"))
    r = subprocess.run(["bash", os.path.join(ROOT, "scripts", "demo.sh")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "demo finished" in r.stdout
    # The sections the demo prints: "== metrics of SERVER (URL), non-zero series", then lines.
    sections = {}
    for block in r.stdout.split("\n== metrics of ")[1:]:
        head, _, body = block.partition("\n")
        body = body.split("\n== ")[0]
        sections[head.split()[0]] = parse(body)
    assert set(sections) == {"planner", "node-0", "node-1"}, list(sections)
    planner = sections["planner"]
    assert series(planner, "ragshard_planner_jobs", state="ready") == 1
    assert series(planner, "ragshard_planner_nodes", state="up") == 2
    assert series(planner, "ragshard_planner_rank_registrations_total") == 4
    # Each node's daemon registered its 2 ranks in one call; no rank called the planner itself
    # (a zero series is not printed).
    assert series(planner, "ragshard_planner_registration_calls_total", method="node") == 2
    assert not [l for n, l, _ in planner
                if n == "ragshard_planner_registration_calls_total" and l["method"] == "rank"]
    assert series(planner, "ragshard_planner_plan_computations_total", result="ok") == 1
    assert series(planner, "ragshard_planner_plan_seconds_count") == 1
    # Each node's daemon took the plan once, compact; the 4 ranks took it from their daemon.
    assert series(planner, "ragshard_planner_plans_sent_total") == 2
    assert 0 < series(planner, "ragshard_planner_plan_bytes_sent_total") < 64 << 10
    for node in ("node-0", "node-1"):
        s = sections[node]
        assert all(v != 0 for _, _, v in s), "only non-zero series are printed"
        ops = {l["kind"]: v for n, l, v in s if n == "ragshard_daemon_operations_total"}
        assert {"unshard", "reshard", "reduce_scatter"} <= set(ops), ops
        assert all(l["result"] == "ok" for n, l, _ in s if n == "ragshard_daemon_operations_total")
        for kind, count in ops.items():
            # The latency histogram saw every operation, its +Inf bucket too.
            assert series(s, "ragshard_daemon_operation_seconds_count", kind=kind) == count
            assert series(s, "ragshard_daemon_operation_seconds_bucket", kind=kind,
                          le="+Inf") == count
        # 3 steps plus the initial gather of each unit: every unit is gathered at least 3 times.
        assert ops["unshard"] >= 3 and ops["unshard"] == ops["reshard"]
        assert series(s, "ragshard_daemon_pool_capacity_bytes") == 512 << 20
        used = series(s, "ragshard_daemon_pool_used_bytes")
        assert 0 < used <= series(s, "ragshard_daemon_pool_peak_bytes") <= 512 << 20
        assert series(s, "ragshard_daemon_jobs") == 1
        sent = [v for n, _, v in s if n == "ragshard_daemon_sent_bytes_total"]
        assert sent and min(sent) > 0, "the two daemons exchanged data over UCX"
        assert not [n for n, _, _ in s if n == "ragshard_daemon_errors_total"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
