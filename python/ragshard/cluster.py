"""A planner and N daemons on this machine, for the demo, the tests and experiments.

    with LocalCluster("build", daemons=2) as c:
        subprocess.run([... "--planner", c.planner, "--sockets", ",".join(c.sockets) ...])

`build_dir` is a CMake build folder (its server/ragshard-planner and server/ragshardd), or None
for the programs on PATH (as `pip install .` puts them there).

Everything listens on 127.0.0.1 (the planner on a port the kernel picks, learnt from its port
file) or on Unix sockets in a temporary directory, and is stopped (SIGTERM, then SIGKILL) on
exit.

Every call needs the planner's token (secure by default). The clusters of one process share one
token, made at the first cluster's start in a private temporary directory (mode 0600) and given
to each planner with --token-file: RAGSHARD_TOKEN_FILE names it in this process's environment
from then on, so that the daemons, the clients of this process and every program it starts
(ranks, ragshard.launch, ragshardctl) carry it, whichever of several live clusters they talk to;
`token_file` names it too. With default_token=True the planner makes its own instead
(DATA_DIR/token), which `token_file` and RAGSHARD_TOKEN_FILE then name until stop() (one such
cluster at a time).

With tls=... the planner serves TLS only (no plaintext listener): a dict of PEM files, "cert" and
"key" the planner's certificate (valid for 127.0.0.1) and "ca" its CA; for mutual TLS,
"client_ca" (the planner requires client certificates it signed) and "client_cert" and
"client_key" (the clients'). The daemons find them in RAGSHARD_TLS_CA, RAGSHARD_TLS_CERT and
RAGSHARD_TLS_KEY, which `tls_env` holds for other clients (ranks, ragshard-launch, ragshardctl);
`tls_options` are Client's and create_job's. A cluster without TLS gives its daemons those
variables empty: plaintext whatever this process's environment says.
"""
import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time


_process_token = None


def process_token_file():
    """This process's token file for its clusters (made once; removed at exit)."""
    global _process_token
    if _process_token is None:
        d = tempfile.mkdtemp(prefix="ragshard-token-")  # mode 0700
        path = os.path.join(d, "token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, (secrets.token_hex(32) + "\n").encode())
        os.close(fd)
        atexit.register(shutil.rmtree, d, True)
        _process_token = path
    return _process_token


class LocalCluster:
    def __init__(self, build_dir, daemons=2, pool_bytes=256 << 20, workdir=None,
                 node_timeout_ms=5000, log=None, cluster_profile=None, backend="host",
                 metrics=False, default_token=False, tls=None, heartbeat_ms=None,
                 pool_commit=False):
        self.build = os.path.abspath(build_dir) if build_dir is not None else None
        self.cluster_profile = cluster_profile
        self.n = daemons
        self.pool_bytes = pool_bytes
        # The daemons' --pool-commit: their pools' pages taken at start (for measurements whose
        # first steps should not pay for pages touched the first time).
        self.pool_commit = pool_commit
        # The daemons' data plane: "host" (unsharded buffers shared by a node's ranks) or
        # "device-shaped" (private per-rank buffers, the shape of a GPU).
        self.backend = backend
        self.node_timeout_ms = node_timeout_ms
        # The daemons' --heartbeat-ms (None: theirs, 1000): a node timeout a few heartbeats
        # long loses a live node whose heartbeat a loaded machine delays.
        self.heartbeat_ms = heartbeat_ms
        self._own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="ragshard-")
        self.procs = []
        self._daemons = {}  # index -> its process (the latest, after start_daemon)
        self.planner = None
        self.sockets = [os.path.join(self.dir, f"d{i}.sock") for i in range(daemons)]
        self.nodes = [f"node-{i}" for i in range(daemons)]
        self.log = log
        # With metrics=True every server serves Prometheus metrics on 127.0.0.1 (a port the
        # kernel picks): `metrics_urls` maps "planner" and each node id to its /metrics URL.
        self.metrics = metrics
        self.metrics_urls = {}
        self.default_token = default_token
        self.token_file = (os.path.join(self.dir, "planner-data", "token") if default_token
                           else process_token_file())
        self._saved_token_env = None
        self.tls = dict(tls or {})
        unknown = set(self.tls) - {"cert", "key", "ca", "client_ca", "client_cert", "client_key"}
        if unknown or (self.tls and not {"cert", "key", "ca"} <= set(self.tls)):
            raise ValueError(f"tls: {sorted(self.tls)} is not cert, key and ca (and client_ca, "
                             "client_cert, client_key for mutual TLS)")
        # How clients reach the planner: the variables and Client's options.
        self.tls_env = {"RAGSHARD_TLS_CA": self.tls.get("ca", ""),
                        "RAGSHARD_TLS_CERT": self.tls.get("client_cert", ""),
                        "RAGSHARD_TLS_KEY": self.tls.get("client_key", ""),
                        "RAGSHARD_TLS_SERVER_NAME": ""}
        self.tls_options = {"tls_ca": self.tls_env["RAGSHARD_TLS_CA"],
                            "tls_cert": self.tls_env["RAGSHARD_TLS_CERT"],
                            "tls_key": self.tls_env["RAGSHARD_TLS_KEY"], "tls_server_name": ""}

    def _bin(self, rel):
        if self.build is None:
            name = os.path.basename(rel)
            path = shutil.which(name)
            if path is None:
                raise FileNotFoundError(
                    f"{name} is not on PATH ({os.environ.get('PATH', '')}): `pip install .` "
                    "puts it there, a CMake build in build/server/")
            return path
        path = os.path.join(self.build, rel)
        if not os.access(path, os.X_OK):
            raise FileNotFoundError(f"{path} is not built (run scripts/test.sh or cmake --build)")
        return path

    # Where the servers run, and how this process sees their files: here, on this machine
    # (NamespacedCluster puts each on a host of its own).
    def _host(self, name):
        """The host of the server logging to `name` ("planner", "daemon<i>..."): None here."""
        return None

    def _seen(self, host, path):
        """`path` on `host` as this process sees it."""
        return path

    def _private_dir(self, host):
        """The directory of `host`'s servers' own files (port file, data, sockets)."""
        return self.dir

    def _listen_address(self, host):
        return "127.0.0.1"

    def _command(self, host, argv):
        """`argv` as run on `host`."""
        return argv

    def _server_env(self):
        return dict(os.environ, GLOG_logtostderr="1", **self.tls_env)

    def _planner_flags(self):
        return []

    def _spawn(self, argv, name):
        out = open(os.path.join(self.dir, name + ".log"), "w")
        # GLOG_logtostderr: the servers' first log line (before their main turns it on) goes to
        # this log too, not to a file of its own in /tmp.
        p = subprocess.Popen(self._command(self._host(name), argv), stdout=out,
                             stderr=subprocess.STDOUT, env=self._server_env())
        out.close()  # the server holds it
        self.procs.append(p)
        return p

    def _log_tail(self, name, chars=2000):
        try:
            with open(os.path.join(self.dir, name + ".log")) as f:
                return f.read()[-chars:]
        except OSError:
            return ""

    def _wait(self, check, proc, what, name, timeout=30.0):
        """`check()`'s first true answer; an error quoting the log if `proc` exits first."""
        deadline = time.time() + timeout
        while True:
            found = check()
            if found:
                return found
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}: "
                                   f"{self._log_tail(name)}")
            if time.time() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout} s; see {self.dir}")
            time.sleep(0.02)

    def _wait_for(self, path, proc, what, name):
        seen = self._seen(self._host(name), path)
        self._wait(lambda: os.path.exists(seen), proc, what, name)

    def _wait_metrics_url(self, proc, what, name):
        """The URL the server's "metrics on URL" line names, once its log has it."""
        def url():
            for line in self._log_tail(name, 1 << 20).splitlines():
                if " metrics on http://" in line and not line.startswith(("I", "W", "E")):
                    return line.split(" metrics on ", 1)[1].strip()
            return None
        return self._wait(url, proc, what, name)

    def _start_planner(self, listen):
        metrics = ["--metrics-listen", "127.0.0.1:0"] if self.metrics else []
        host = self._host("planner")
        own = self._private_dir(host)
        port_file = os.path.join(own, "planner.port")
        if os.path.exists(self._seen(host, port_file)):
            os.unlink(self._seen(host, port_file))
        os.makedirs(self._seen(host, os.path.join(own, "planner-data")), mode=0o700,
                    exist_ok=True)
        token = [] if self.default_token else ["--token-file", self.token_file]
        tls = []
        if self.tls:
            tls = ["--tls-cert", self.tls["cert"], "--tls-key", self.tls["key"]]
            if self.tls.get("client_ca"):
                tls += ["--tls-client-ca", self.tls["client_ca"]]
        p = self._spawn([self._bin("server/ragshard-planner"), "--listen", listen] + token + tls + [
                         "--data-dir", os.path.join(own, "planner-data"),
                         "--port-file", port_file,
                         "--node-timeout-ms", str(self.node_timeout_ms)] + metrics +
                        self._planner_flags() +
                        (["--cluster-profile", self.cluster_profile] if self.cluster_profile
                         else []), "planner")
        self._planner_proc = p
        self._wait_for(port_file, p, "ragshard-planner", "planner")
        if self.metrics:
            self.metrics_urls["planner"] = self._wait_metrics_url(p, "ragshard-planner", "planner")
        for _ in range(100):
            with open(self._seen(host, port_file)) as f:
                self.planner = f.read().strip()
            if self.planner:
                break
            time.sleep(0.02)

    def kill_planner(self):
        """kill -9 of the planner (its state stays in the data directory)."""
        self._planner_proc.kill()
        self._planner_proc.wait()

    def restart_planner(self):
        """Starts the planner again on the same address and data directory (after
        kill_planner): clients and daemons that retry find it there."""
        self._start_planner(self.planner)

    def start(self):
        for program in ("server/ragshard-planner", "server/ragshardd"):
            self._bin(program)  # a missing program is named before anything starts
        self._start_planner(self._listen_address(self._host("planner")) + ":0")
        if self.default_token:
            self._saved_token_env = (os.environ.get("RAGSHARD_TOKEN_FILE"),)
        os.environ["RAGSHARD_TOKEN_FILE"] = self.token_file
        for i in range(self.n):
            self.start_daemon(i)
        return self

    def start_daemon(self, i, log_suffix=""):
        """Starts daemon `i` (node id and socket as at start): at start, and as the replacement
        of a daemon kill_daemon stopped (docs/recovery.md, "A lost node")."""
        flags = ["--metrics-listen", "127.0.0.1:0"] if self.metrics else []
        if self.heartbeat_ms is not None:
            flags += ["--heartbeat-ms", str(int(self.heartbeat_ms))]
        if self.pool_commit:
            flags += ["--pool-commit"]
        name = f"daemon{i}{log_suffix}"
        host = self._host(name)
        if host is not None:  # its data plane on the host's own address
            flags += ["--data-listen", self._listen_address(host) + ":0"]
        for stale in (self._seen(host, self.sockets[i] + ".fd"),):
            if os.path.exists(stale):
                os.unlink(stale)
        d = self._spawn([self._bin("server/ragshardd"), "--planner", self.planner,
                         "--node-id", self.nodes[i], "--socket", self.sockets[i],
                         "--pool-bytes", str(self.pool_bytes), "--backend", self.backend] +
                        flags, name)
        self._daemons[i] = d
        self._wait_for(self.sockets[i] + ".fd", d, f"ragshardd {self.nodes[i]}", name)
        if self.metrics:
            self.metrics_urls[self.nodes[i]] = self._wait_metrics_url(
                d, f"ragshardd {self.nodes[i]}", name)
        return d

    def daemon(self, i):
        """Daemon `i`'s process (the latest start_daemon's)."""
        return self._daemons[i]

    def kill_daemon(self, i):
        """kill -9 of daemon `i` (its pool is lost with it)."""
        self._daemons[i].kill()
        self._daemons[i].wait()

    def stop(self):
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        for p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []
        if self._saved_token_env is not None:
            saved = self._saved_token_env[0]
            if saved is None:
                os.environ.pop("RAGSHARD_TOKEN_FILE", None)
            else:
                os.environ["RAGSHARD_TOKEN_FILE"] = saved
            self._saved_token_env = None
        if self._own_dir and os.environ.get("RAGSHARD_KEEP_LOGS") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)

    def attach(self, job, inventory, ranks=2, daemon=0, timeout_ms=30000, local_ranks=None,
               **client_options):
        """Creates job `job` of `ranks` ranks, all on daemon `daemon` (None: spread over the
        daemons in order, ranks // daemons each), and returns a registered and attached Client
        per rank (`inventory` a dict; `client_options` go to Client; `local_ranks`, by default
        each daemon's count of the ranks, is what the ranks tell their daemon). The ranks attach in
        threads, since each attach waits for the others; the first error is raised."""
        from . import Client, create_job  # the package imports this module's users, not it
        create_job(self.planner, job, ranks, **self.tls_options)
        where = [daemon if daemon is not None else r * self.n // ranks for r in range(ranks)]
        client_options = dict(self.tls_options, **client_options)
        clients = [Client(self.planner, self.sockets[where[r]], job, r, self.nodes[where[r]],
                          timeout_ms, local_ranks=where.count(where[r]) if local_ranks is None
                          else local_ranks, **client_options)
                   for r in range(ranks)]
        errors = []

        def go(client):
            try:
                client.register(json.dumps(inventory), True)
                client.attach()
            except Exception as e:  # raised below, in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=go, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return clients

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()
        return False


class NamespacedCluster(LocalCluster):
    """A planner and N daemons each on a host of its own (ragshard.hosts: a network namespace
    with its own address on a private bridge, and a private /tmp), as separate machines would
    be: nothing is shared between them but the network and the machine's software.

        with NamespacedCluster("build", daemons=2) as c:
            c.spawn("node-0", [sys.executable, ...], env=c.rank_env(...))

    The hosts are "planner", the node ids and `spare_hosts` spares ("spare-<j>"). The build, the
    interpreter's environment and `shared` stay visible on every host even under /tmp. The
    planner listens on its host's address (port file in its /tmp), each daemon's socket is
    /tmp/ragshard/d<i>.sock on its own host and its data plane listens on its host's address.
    The token is copied into each host's /tmp/ragshard/token (`token_file` names that path, on
    every host). This process is on none
    of the hosts (it has no route to them): clients run on a host (`spawn`, `run`). Metrics and
    TLS are LocalCluster's only (their addresses are 127.0.0.1): the planner serves plaintext on
    the private bridge (--insecure).
    """

    def __init__(self, build_dir, daemons=2, spare_hosts=0, shared=(), **options):
        if options.get("metrics") or options.get("tls") or options.get("default_token"):
            raise ValueError("NamespacedCluster: metrics, tls and default_token are "
                             "LocalCluster's only")
        from .hosts import Hosts
        # Its logs and the test's own files: outside /tmp, which each host has of its own.
        options.setdefault("workdir", tempfile.mkdtemp(prefix="ragshard-ns-", dir="/var/tmp"))
        super().__init__(build_dir, daemons=daemons, **options)
        self._own_dir = True
        self.sockets = [f"/tmp/ragshard/d{i}.sock" for i in range(daemons)]
        # Spare hosts ("spare-<j>") for replacements: start_daemon(i, host="spare-0").
        # The software every host runs, where it lies under /tmp (a checkout there), and what the
        # caller shares on purpose.
        software = [self.build, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))]
        self.hosts = Hosts(["planner"] + self.nodes + [f"spare-{j}" for j in range(spare_hosts)],
                           shared=[p for p in software + list(shared) if p])
        self._host_token = "/tmp/ragshard/token"
        self._daemon_hosts = {}  # a daemon's log name -> its host

    def start_daemon(self, i, log_suffix="", host=None):
        """Daemon `i` (node id nodes[i]) on its own host, or on `host` (a replacement of it on a
        spare host)."""
        self._daemon_hosts[f"daemon{i}{log_suffix}"] = host or self.nodes[i]
        return super().start_daemon(i, log_suffix)

    def _host(self, name):
        return self._daemon_hosts.get(name, "planner")

    def _seen(self, host, path):
        return self.hosts.seen(host, path)

    def _private_dir(self, host):
        return "/tmp/ragshard"

    def _listen_address(self, host):
        return self.hosts.address(host)

    def _command(self, host, argv):
        return self.hosts.command(host, argv)

    def _server_env(self):
        return dict(super()._server_env(), RAGSHARD_TOKEN_FILE=self._host_token)

    def _planner_flags(self):
        # Plaintext beyond loopback: the bridge is the test's own, in namespaces nothing else
        # reaches (a planner refuses it unless told).
        return ["--insecure"]

    def start(self):
        self.hosts.start()
        with open(self.token_file) as f:
            token = f.read()
        for host in self.hosts.names:
            own = self.hosts.seen(host, "/tmp/ragshard")
            os.makedirs(own, mode=0o700, exist_ok=True)
            fd = os.open(os.path.join(own, "token"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, token.encode())
            os.close(fd)
        self.token_file = self._host_token  # as every host names it
        for program in ("server/ragshard-planner", "server/ragshardd"):
            self._bin(program)
        self._start_planner(self._listen_address("planner") + ":0")
        for i in range(self.n):
            self.start_daemon(i)
        return self

    def stop(self):
        super().stop()
        self.hosts.close()

    def env(self, **more):
        """The environment of a program on a host: the token and the planner's address."""
        return dict(os.environ, RAGSHARD_TOKEN_FILE=self._host_token,
                    RAGSHARD_PLANNER=self.planner, **more)

    def spawn(self, host, argv, cwd=None, **popen):
        return self.hosts.spawn(host, argv, cwd, **popen)

    def launcher(self, job, node_rank, daemon, nnodes, nproc, create=True):
        """The arguments of `python -m ragshard.launch` for node rank `node_rank` of `nnodes`
        of `job` (`nproc` ranks in all) on daemon `daemon`'s host, with --create-job unless
        `create` is false (the job made before); the launcher's other flags, the script and
        its arguments follow."""
        return ["-m", "ragshard.launch", "--planner", self.planner, "--job", job,
                *["--create-job"] * create, "--nproc", str(nproc), "--nnodes", str(nnodes),
                "--node-rank", str(node_rank), "--sockets", self.sockets[daemon],
                "--nodes", self.nodes[daemon]]

    def run(self, host, argv, cwd=None, **run):
        return self.hosts.run(host, argv, cwd, **run)
