"""TLS from Python: certificates made here with openssl (a CA, the planner's for 127.0.0.1 and
localhost, a client's), a planner that serves TLS only (no plaintext listener) and two daemons
that reach it through RAGSHARD_TLS_CA; examples/train_tiny.py trains 2 daemons x 2 ranks through
ragshard-launch with the TLS variables set, to the end. A client without the CA fails within its
retry window, naming TLS. Mutual TLS: a client without a certificate is refused, one with it
(options or variables; the Python client and ragshardctl) is served."""
import os
import shutil
import subprocess
import sys
import time

import pytest
import preloaded  # beside this file: the launches forked from one torch import

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

import ragshard  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")

EXAMPLE = os.path.join(ROOT, "examples", "train_tiny.py")
SMALL = ["--layers", "2", "--dim", "64", "--heads", "4", "--seq", "16", "--batch", "2",
         "--vocab", "32", "--quiet", "--steps", "3"]
TLS_VARS = ("RAGSHARD_TLS_CA", "RAGSHARD_TLS_CERT", "RAGSHARD_TLS_KEY",
            "RAGSHARD_TLS_SERVER_NAME")
INVENTORY = {"units": [{"name": "a", "tensors": [{"name": "w", "shape": [64, 8],
                                                  "dtype": "fp32"}]}]}


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """PEM files: ca, server (127.0.0.1, localhost), client; each .pem with its .key."""
    d = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=ragshard-test-ca", "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                 "extendedKeyUsage=serverAuth\n"),
                      ("client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text(ext)
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=ragshard-{name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out",
                f"{name}.pem", cwd=d)
    return {n: str(d / n) for n in ("ca.pem", "server.pem", "server.key", "client.pem",
                                    "client.key")}


def env(**extra):
    e = {k: v for k, v in os.environ.items() if k not in TLS_VARS}
    e["PYTHONPATH"] = os.path.join(BUILD, "python") + os.pathsep + e.get("PYTHONPATH", "")
    e.update(extra)
    return e


def refused_naming_tls(call):
    """`call()` fails within its short retry window, naming TLS."""
    start = time.time()
    with pytest.raises(ragshard.Error) as e:
        call()
    assert time.time() - start < 20, "not bounded by RAGSHARD_PLANNER_RETRY_S"
    assert e.value.args[0].startswith("UNAVAILABLE") and "TLS" in e.value.args[0], e.value
    return e.value.args[0]


def test_training_through_a_tls_only_planner(certs, tmp_path, monkeypatch):
    tls = {"cert": certs["server.pem"], "key": certs["server.key"], "ca": certs["ca.pem"]}
    with LocalCluster(BUILD, daemons=2, pool_bytes=128 << 20, tls=tls) as c:
        launch = [sys.executable, "-m", "ragshard.launch", "--preload", "torch", "--planner",
                  c.planner, "--nproc", "4", "--sockets", ",".join(c.sockets), "--create-job"]
        # The launcher and its ranks take the CA from RAGSHARD_TLS_CA.
        r = preloaded.run(launch + ["--job", "tls", EXAMPLE, "--out", str(tmp_path / "tls")] +
                           SMALL, env=env(**c.tls_env), capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        assert os.path.exists(str(tmp_path / "tls") + ".json"), r.stdout + r.stderr
        # Without the CA the launcher's client speaks plaintext to a TLS port: refused within
        # RAGSHARD_PLANNER_RETRY_S, naming TLS, and no rank trains.
        start = time.time()
        r = preloaded.run(launch + ["--job", "plain", EXAMPLE] + SMALL,
                           env=env(RAGSHARD_PLANNER_RETRY_S="1"), capture_output=True,
                           text=True, timeout=120)
        assert r.returncode != 0 and time.time() - start < 60
        assert "UNAVAILABLE" in r.stderr and "without TLS" in r.stderr, r.stderr
        # The same from the Python API; with the CA as an argument it is served.
        monkeypatch.setenv("RAGSHARD_PLANNER_RETRY_S", "1")
        for var in TLS_VARS:
            monkeypatch.delenv(var, raising=False)
        refused_naming_tls(lambda: ragshard.create_job(c.planner, "api", 2))
        ragshard.create_job(c.planner, "api", 2, tls_ca=certs["ca.pem"])
        assert ragshard.job_world_size(c.planner, "api", tls_ca=certs["ca.pem"]) == 2
        # A CA that did not sign the planner's certificate: the handshake fails, naming TLS.
        message = refused_naming_tls(lambda: ragshard.job_world_size(
            c.planner, "api", tls_ca=certs["client.pem"]))
        assert "over TLS" in message


def test_mutual_tls(certs, monkeypatch):
    tls = {"cert": certs["server.pem"], "key": certs["server.key"], "ca": certs["ca.pem"],
           "client_ca": certs["ca.pem"], "client_cert": certs["client.pem"],
           "client_key": certs["client.key"]}
    monkeypatch.setenv("RAGSHARD_PLANNER_RETRY_S", "1")
    for var in TLS_VARS:
        monkeypatch.delenv(var, raising=False)
    with LocalCluster(BUILD, daemons=1, pool_bytes=64 << 20, tls=tls) as c:
        # The daemon registered with its certificate (RAGSHARD_TLS_CERT/KEY); two ranks attach
        # with theirs as Client's options.
        clients = c.attach("mtls", INVENTORY, ranks=2)
        assert [x.world_size for x in clients] == [2, 2]
        del clients
        refused_naming_tls(lambda: ragshard.job_world_size(c.planner, "mtls",
                                                           tls_ca=certs["ca.pem"]))
        # The variables serve as well: the Python client's and ragshardctl's.
        for var, value in c.tls_env.items():
            monkeypatch.setenv(var, value)
        assert ragshard.job_world_size(c.planner, "mtls") == 2
        ctl = os.path.join(BUILD, "ctl", "ragshardctl")
        r = subprocess.run([ctl, "jobs", "--planner", c.planner], env=env(**c.tls_env),
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "mtls" in r.stdout, r.stdout + r.stderr
        r = subprocess.run([ctl, "jobs", "--planner", c.planner, "--retry-s", "0"],
                           env=env(RAGSHARD_TLS_CA=certs["ca.pem"]), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0 and "TLS" in r.stderr, r.stdout + r.stderr
