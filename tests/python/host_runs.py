"""What the training tests on hosts of their own share (ragshard.cluster.NamespacedCluster; beside
them: `import host_runs`): a launcher per host, holding ranks at a point and waiting for them,
losing or partitioning a host, each launcher's outcome, ragshardctl on the planner's host, and
the comparisons of two runs' outputs. Outputs live outside /tmp (each host has its own), in the
cluster's directory, which every host sees."""
import json
import os
import subprocess
import sys
import time

# beside this file; cluster_runs puts the build's package on the path
import preloaded
import torch
from cluster_runs import BUILD, ROOT, env

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet", "--steps", "4", "--optimizer", "adamw"]
# A launch that recovers in place: its ranks restarted once, each daemon's state copied to another.
RECOVERS = ["--max-restarts", "1", "--redundancy", "replica", "--recovery-deadline", "90"]
# Every launcher here forks its ranks from its own import of torch (which it has from the tests'
# preloaded interpreter): test_hosts starts the plain launch, an interpreter per rank, itself.
PRELOADED = ["--preload", "torch"]


def loopback_reference(out):
    """train_tiny (SMALL) over 4 ranks and 2 daemons on loopback, through ragshard.launch: what a
    training across hosts must equal. Its output path."""
    from ragshard.cluster import LocalCluster
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20) as c:
        r = subprocess.run([sys.executable, "-m", "ragshard.launch", "--planner", c.planner,
                            "--job", "loop", "--create-job", "--nproc", "4", "--sockets",
                            ",".join(c.sockets), EXAMPLE, "--out", out] + SMALL,
                           env=env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
    return out


def launchers(c, job, out, where, extra=(), flags=(), nnodes=2, base=RECOVERS, script=SMALL,
              paths=(), create=True, **more_env):
    """A launcher per entry of `where` for `job` (train_tiny with `script` and `extra`, writing
    `out`), of `nnodes` hosts x 2 ranks: (node rank, host), or (node rank, host, daemon index)
    where the host's daemon is not daemon <node rank>. Its flags: `base`, then `flags` (later
    ones winning), after PRELOADED; --create-job unless `create` is false (the job made
    before). Each in a session of its own, with `more_env` and `paths` first on its
    PYTHONPATH."""
    pythonpath = os.pathsep.join(list(paths) + [env()["PYTHONPATH"]])
    procs = {}
    for k, host, *daemon in where:
        i = daemon[0] if daemon else k
        procs[k] = spawn(c, host, c.launcher(job, k, i, nnodes, 2 * nnodes, create) +
                         [*PRELOADED, *base, *flags, EXAMPLE, "--out", out] + list(script) +
                         list(extra), PYTHONPATH=pythonpath, **more_env)
    return procs


def spawn(c, host, args, stdout=None, **more_env):
    """`python ARGS` on `host` (ragshard.launch, or a script) with the cluster's environment and
    `more_env`, forked from the tests' preloaded interpreter (preloaded.spawn: in the host's
    namespaces, a session of its own), its output to `stdout` or kept for communicate()."""
    return preloaded.spawn([sys.executable, *args], host=c.hosts.holder(host),
                           env=c.env(**more_env), stdout=stdout)


def held(procs, marks, seconds=240):
    """Waits until every mark exists (the held ranks wrote their pids there), every launcher
    still running; the held ranks' pids."""
    deadline = time.time() + seconds
    while not all(os.path.exists(m) for m in marks):
        ended = {k: p.returncode for k, p in procs.items() if p.poll() is not None}
        assert not ended, f"a launcher ended before the hold: {ended}: {outputs(procs, 60)}"
        assert time.time() < deadline, "the held ranks did not reach the hold"
        time.sleep(0.05)
    return [int(open(m).read()) for m in marks]


def gone(pid):
    """The process has exited (no such process, or a zombie)."""
    if not os.path.exists(f"/proc/{pid}"):
        return True
    return open(f"/proc/{pid}/stat").read().split(") ")[1].split()[0] == "Z"


def lose_host(c, procs, k, host=None, i=None):
    """Node rank `k`'s host (`host`, else node k's own) is lost as a host is: its link goes down,
    then everything on it dies (its launcher's session: the launcher and its ranks; then its
    daemon, daemon `i`, else k), no packet leaving it. Its launcher leaves `procs`. The time of
    the cut."""
    i = k if i is None else i
    c.hosts.link_down(host or c.nodes[i])
    cut = time.time()
    stop([procs.pop(k)])
    c.kill_daemon(i)
    return cut


def partition(c, host, marks, pids, lease_s):
    """Cuts `host`'s link while everything on it lives and lets its held ranks go, into an
    operation that cannot finish; once its daemon's lease ran out they exit. The time of the
    cut and the seconds until they stopped (at most the lease and 15 s)."""
    c.hosts.link_down(host)
    cut = time.time()
    for m in marks:
        os.unlink(m)
    while not all(gone(p) for p in pids):
        assert time.time() - cut < lease_s + 30, f"{host}'s ranks did not stop"
        time.sleep(0.05)
    stopped = time.time() - cut
    # The fence comes at most a lease after the cut (before the planner can declare the node
    # lost); the ranks then exit.
    assert stopped < lease_s + 15, stopped
    return cut, stopped


def stop(procs):
    """Kills each launcher's session still running (it and its ranks)."""
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()


def outputs(procs, timeout=300):
    """Each launcher's (exit code, output), waiting for all of them; the sessions of any still
    running then are killed."""
    got = {}
    try:
        for k, p in procs.items():
            got[k] = (p.communicate(timeout=timeout)[0], p.returncode)
    finally:
        stop(procs.values())
    return {k: (rc, text) for k, (text, rc) in got.items()}


def finish(procs, timeout=300):
    """Waits for every launcher; each must end with 0. Their outputs."""
    got = outputs(procs, timeout)
    for k, (rc, text) in got.items():
        assert rc == 0, f"node rank {k}'s launcher: {text[-4000:]}"
    return {k: text for k, (_, text) in got.items()}


def ctl(c, *args):
    """ragshardctl ARGS on the planner's host: its output and errors."""
    r = c.run("planner", [os.path.join(BUILD, "ctl", "ragshardctl"), "--planner", c.planner,
                          "--token-file", c.token_file, *args],
              capture_output=True, text=True, timeout=60)
    return r.stdout + r.stderr


def assert_same(out, ref, atol=0.0):
    """The final parameters of two runs (PREFIX.pt): equal, or within `atol` each."""
    a, b = torch.load(out + ".pt"), torch.load(ref + ".pt")
    assert a.keys() == b.keys()
    for name in a:
        same = torch.equal(a[name], b[name]) if atol == 0 else \
            torch.allclose(a[name], b[name], rtol=0, atol=atol)
        assert same, f"{name}: max |delta| {float((a[name] - b[name]).abs().max()):.3g}"


def assert_resumed(out, ref, atol=1e-5):
    """A shrunk run (PREFIX.json: the losses from its `first_step`) against its reference,
    saved before the shrink and resumed at the smaller world: the losses of the steps both
    ran, and the final parameters, within `atol`. The shrunk run's record."""
    with open(out + ".json") as f:
        shrunk = json.load(f)
    with open(ref + ".json") as f:
        resumed = json.load(f)
    a = shrunk["losses"]
    b = resumed["losses"][shrunk["first_step"] - resumed["first_step"]:]
    assert len(a) == len(b) > 0, (shrunk, resumed)
    assert max(abs(x - y) for x, y in zip(a, b)) <= atol, (a, b)
    assert_same(out, ref, atol=atol)
    return shrunk
