"""Hosts of their own on this machine, for tests and benchmarks that must see what a cluster sees:
each host a network namespace with its own address on a private bridge, and a mount namespace
with a private /tmp; and a planner and daemons on such hosts (NamespacedCluster).

    with Hosts(["planner", "node-0", "node-1"]) as h:
        h.run("node-0", ["python3", "-c", "..."])          # runs there
        h.link_down("node-1")                              # its packets vanish: no reset

Nothing leaves the machine, and nothing of the root namespaces is touched: the bridge lives in a
namespace of its own ("switch"), each host's end of its veth pair in the host's namespace, on
addresses of a 10.x.y.0/24 subnet drawn at random (the root namespace has no route to it). Each
host's /tmp is a tmpfs of its own: its servers' sockets, port files and data directories are
the host's alone, as on separate machines; the rest of the filesystem (the build, the virtual
environment) is the machine's, as a shared software install would be. Paths under /tmp that
every host must see (a checkout or build that lies there, a directory shared on purpose as NFS
would be) are given as `shared`: each is bound at the same path into every host's /tmp. A host
is held by a process (`sleep`) in its namespaces; commands join them with nsenter, and this
process reads a host's files through /proc/<holder>/root.

Every namespace, link and mount is removed on exit, also when the block fails, and at this
process's exit (atexit) if a block never ended; namespaces a killed process left behind (their
names carry its pid) are removed by the next Hosts. Needs root (CI runs as root) and iproute2,
util-linux (unshare, nsenter): `Hosts.unavailable()` names what is missing, for tests to fail
or skip on.
"""
import atexit
import os
import random
import shlex
import shutil
import subprocess

PREFIX = "rsh"  # the namespaces' names: rsh<pid>x<n>-<host>
_counter = 0


def unavailable():
    """Why hosts cannot be made here ("" where they can)."""
    if os.geteuid() != 0:
        return "network and mount namespaces need root (CI runs as root)"
    missing = [t for t in ("ip", "unshare", "nsenter") if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} not found (iproute2, util-linux)"
    return ""


def _ip(*args, check=True):
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip() or r.returncode}")
    return r


def _remove_orphans():
    """Deletes the namespaces of earlier Hosts whose process is gone (killed before cleanup)."""
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX) or "x" not in name:
            continue
        pid = name[len(PREFIX):].split("x", 1)[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            _ip("netns", "del", name, check=False)


class Hosts:
    """Hosts named `names`, each with an address on one bridge (`address(name)`)."""

    def __init__(self, names, tmp_bytes=1 << 30, shared=()):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"host names must be distinct and given: {names}")
        if len(names) > 250:
            raise ValueError(f"{len(names)} hosts: at most 250 on one /24")
        why = unavailable()
        if why:
            raise RuntimeError(f"hosts in namespaces cannot be made: {why}")
        global _counter
        _counter += 1
        self.tag = f"{PREFIX}{os.getpid()}x{_counter}"
        self.names = list(names)
        self.tmp_bytes = tmp_bytes
        # The shared paths under /tmp, as paths relative to it (the others need no binding),
        # those inside another left out (they come with it).
        under = sorted({os.path.relpath(os.path.realpath(p), "/tmp") for p in shared
                        if os.path.realpath(p).startswith("/tmp/")})
        self.shared = [r for r in under
                       if not any(r.startswith(o + os.sep) for o in under if o != r)]
        subnet = (random.randrange(64, 250), random.randrange(0, 256))
        self.prefix = f"10.{subnet[0]}.{subnet[1]}"
        self._addresses = {n: f"{self.prefix}.{i + 1}" for i, n in enumerate(self.names)}
        self._holders = {}
        self._made = []  # namespaces made, in order (removed in reverse)
        self._closed = False

    # Names.
    def netns(self, host):
        return f"{self.tag}-{self.names.index(host)}"

    def address(self, host):
        return self._addresses[host]

    def holder(self, host):
        """The pid of the process that holds `host`'s namespaces."""
        return self._holders[host].pid

    def seen(self, host, path):
        """`host`'s absolute `path` as this process sees it."""
        return f"/proc/{self.holder(host)}/root{path}"

    # Life.
    def start(self):
        _remove_orphans()
        atexit.register(self.close)
        switch = f"{self.tag}-sw"
        _ip("netns", "add", switch)
        self._made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(self.names):
            ns = self.netns(host)
            _ip("netns", "add", ns)
            self._made.append(ns)
            port = f"p{i}"
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.address(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self._hold(host, ns)
        return self

    def _hold(self, host, ns):
        # `ip netns exec` mounts the namespace's own /sys (UCX finds its interfaces there) in a
        # mount namespace of its own; unshare makes the holder's, private, with a /tmp of its own.
        # The shared paths are bound back from the machine's /tmp, which fd 3 keeps reachable
        # under the new one.
        # (--no-canonicalize: mount would resolve the source to its path, the new /tmp's.)
        binds = "".join(f"mkdir -p {shlex.quote('/tmp/' + rel)} && "
                        "mount --no-canonicalize --bind "
                        f"{shlex.quote('/proc/self/fd/3/' + rel)} {shlex.quote('/tmp/' + rel)} && "
                        for rel in self.shared)
        script = (f"exec 3</tmp && mount -t tmpfs -o mode=1777,size={self.tmp_bytes} tmpfs /tmp "
                  f"&& {binds}exec 3<&- && echo ready && exec sleep infinity")
        p = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount",
                              "--propagation", "private", "sh", "-c", script],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._holders[host] = p
        line = p.stdout.readline()
        if line.strip() != "ready":
            p.kill()
            raise RuntimeError(f"host {host}: its namespaces could not be held: "
                               f"{line.strip()} {p.stderr.read().strip()}")

    def close(self):
        """Stops the holders and removes every namespace (their links and bridge with them)."""
        if self._closed:
            return
        self._closed = True
        for p in self._holders.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made = []

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc):
        self.close()
        return False

    # Work on a host.
    def command(self, host, argv, cwd=None):
        """`argv` as a command that runs on `host` (its network and mount namespaces), in `cwd`
        (default: this process's; entering a mount namespace would otherwise start it in /)."""
        return ["nsenter", f"--target={self.holder(host)}", "--mount", "--net",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def spawn(self, host, argv, cwd=None, **popen):
        return subprocess.Popen(self.command(host, argv, cwd), **popen)

    def run(self, host, argv, cwd=None, **run):
        return subprocess.run(self.command(host, argv, cwd), **run)

    # Faults.
    def link_down(self, host):
        """`host`'s link goes down: its packets and those to it vanish, and no connection of it
        is reset (a host that lost power or its cable, as its peers see it)."""
        _ip("-n", self.netns(host), "link", "set", "eth0", "down")

    def link_up(self, host):
        _ip("-n", self.netns(host), "link", "set", "eth0", "up")

    def lossy(self, host, percent):
        """`host`'s link drops `percent` % of its packets (eth0's), each way, at random (0:
        none again): an nftables table in the host's namespace (Debian's nftables; RuntimeError
        naming why where it cannot be made). Its connections stay up; TCP retransmits what is
        lost."""
        if not 0 <= int(percent) <= 100:
            raise ValueError(f"percent: {percent} is not in [0, 100]")
        if shutil.which("nft") is None:
            raise RuntimeError("lossy links need nft (Debian's nftables)")
        ns = self.netns(host)
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet",
                        "ragshard_loss"], capture_output=True)
        if int(percent) == 0:
            return
        some = "" if int(percent) == 100 else f"numgen random mod 100 < {int(percent)} "
        rules = ("table inet ragshard_loss {\n"
                 "  chain in { type filter hook input priority 0; "
                 f"iifname eth0 {some}drop; }}\n"
                 "  chain out { type filter hook output priority 0; "
                 f"oifname eth0 {some}drop; }}\n}}\n")
        r = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"nft in {ns}: {r.stderr.strip() or r.returncode}")
