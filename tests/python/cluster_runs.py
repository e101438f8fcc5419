"""What the multi-node training tests share (beside them: `import cluster_runs`): the checkout
and build they run (ROOT, BUILD, with the build's Python package importable), the launches'
environment (env) and ragshardctl against a LocalCluster (ctl)."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))


def env():
    """The launches' environment: the build's package and the tests' directory (their fault
    hooks) importable."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([os.path.join(BUILD, "python"),
                                       os.path.dirname(os.path.abspath(__file__)),
                                       e.get("PYTHONPATH", "")])
    return e


def ctl(cluster, *args):
    """ragshardctl ARGS against `cluster`'s planner, with its token."""
    return subprocess.run([os.path.join(BUILD, "ctl", "ragshardctl"), "--planner",
                           cluster.planner, "--token-file", cluster.token_file, *args],
                          capture_output=True, text=True, timeout=60)


def require_namespaces():
    """Hosts in namespaces (ragshard.hosts) for a test module: where they cannot be made, the
    module fails naming why when RAGSHARD_REQUIRE_NAMESPACES=1 (.ci/run sets it), and skips with
    that reason elsewhere."""
    import pytest

    from ragshard import hosts
    why = hosts.unavailable()
    if why:
        if os.environ.get("RAGSHARD_REQUIRE_NAMESPACES") == "1":
            pytest.fail(f"hosts in namespaces are required here: {why}", pytrace=False)
        pytest.skip(why, allow_module_level=True)
