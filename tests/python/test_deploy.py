"""The deploy/ manifests are checked: the systemd units pass `systemd-analyze verify` (with the
programs' paths pointed at this build), the Kubernetes manifests parse and hang together, and
every program, flag, port, volume and secret they name exists: each flag in the program's own
--help, each volume mounted declared, each Service port a container's port."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
DEPLOY = os.path.join(ROOT, "deploy")
PROGRAMS = {"ragshard-planner": [os.path.join(BUILD, "server", "ragshard-planner")],
            "ragshardd": [os.path.join(BUILD, "server", "ragshardd")],
            "ragshardctl": [os.path.join(BUILD, "client", "ragshardctl")],
            "ragshard-launch": [sys.executable, "-m", "ragshard.launch"]}


def env():
    return dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python") + os.pathsep +
                os.environ.get("PYTHONPATH", ""))


_HELP = {}


def flags_of(program, command=()):
    """The long flags that `program [command...] --help` lists."""
    key = (program, *command)
    if key not in _HELP:
        r = subprocess.run(PROGRAMS[program] + list(command) + ["--help"], capture_output=True,
                           text=True, env=env(), timeout=60)
        assert r.returncode == 0, r.stderr
        _HELP[key] = set(re.findall(r"(--[a-z][a-z0-9-]*)", r.stdout))
    return _HELP[key]


def check_flags(program, args, command=()):
    """Every --flag of `args` (up to a script's name, for ragshard-launch) is one of the
    program's (or of its sub-command `command`'s)."""
    for a in args:
        if program == "ragshard-launch" and not a.startswith("-"):
            break  # the training script and its own arguments
        if a.startswith("--"):
            flag = a.split("=", 1)[0]
            assert flag in flags_of(program) | flags_of(program, command), \
                f"{program} {' '.join(command)} has no flag {flag}"


def unit_exec(path):
    """The ExecStart= line of a unit, continuation lines joined, as a list of words."""
    text = open(path).read().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
    return line[len("ExecStart="):].split()


UNITS = ["ragshard-planner.service", "ragshardd.service"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed (scripts/install-deps.sh: systemd)")
def test_systemd_units_verify_and_name_real_flags(tmp_path):
    copies = []
    for name in UNITS:
        text = open(os.path.join(DEPLOY, "systemd", name)).read()
        words = unit_exec(os.path.join(DEPLOY, "systemd", name))
        program = os.path.basename(words[0])
        assert words[0] == f"/usr/local/bin/{program}", words[0]  # where cmake --install puts it
        check_flags(program, words[1:])
        # verify checks that ExecStart's program exists: this build's.
        copy = tmp_path / name
        copy.write_text(text.replace(words[0], PROGRAMS[program][0]))
        copies.append(str(copy))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *copies], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout + r.stderr == "", r.stdout + r.stderr
    # The daemon's settings file gives every variable its ExecStart uses.
    daemon = " ".join(unit_exec(os.path.join(DEPLOY, "systemd", "ragshardd.service")))
    settings = open(os.path.join(DEPLOY, "systemd", "ragshardd.env")).read()
    for var in re.findall(r"\$\{(\w+)\}", daemon):
        assert re.search(rf"^{var}=\S", settings, re.M), f"ragshardd.env does not set {var}"
    # The group the daemon gives its socket to is the one sysusers creates.
    sysusers = open(os.path.join(DEPLOY, "systemd", "ragshard.sysusers.conf")).read()
    group = re.search(r"--socket-group (\S+)", daemon)[1]
    assert re.search(rf"^g {group} ", sysusers, re.M)


def manifests():
    out = []
    for name in sorted(os.listdir(os.path.join(DEPLOY, "kubernetes"))):
        with open(os.path.join(DEPLOY, "kubernetes", name)) as f:
            out += [(name, d) for d in yaml.safe_load_all(f) if d is not None]
    return out


def pod_specs(docs):
    for name, d in docs:
        spec = d.get("spec", {})
        if d["kind"] in ("StatefulSet", "DaemonSet", "Job", "Deployment"):
            yield name, d, spec["template"]["spec"]


def test_kubernetes_manifests_parse_and_hang_together():
    docs = manifests()
    kinds = {d["kind"] for _, d in docs}
    assert {"Namespace", "Secret", "Service", "StatefulSet", "DaemonSet", "Job"} <= kinds, kinds
    for name, d in docs:
        assert d.get("apiVersion") and d.get("metadata", {}).get("name"), (name, d)
    secrets = {d["metadata"]["name"] for _, d in docs if d["kind"] == "Secret"}
    programs_seen = set()
    for name, d, pod in pod_specs(docs):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in d["spec"].get("volumeClaimTemplates", [])}
        for c in pod.get("initContainers", []) + pod["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes or m["name"] in claims, (name, c["name"], m)
            program = c["command"][0]
            if program in PROGRAMS:
                programs_seen.add(program)
                check_flags(program, c.get("args", []))
            else:
                assert program == "sh", (name, program)  # the init containers' token copy
        for v in volumes.values():
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets, (name, v)
    assert {"ragshard-planner", "ragshardd", "ragshard-launch"} <= programs_seen
    # The planner's Service reaches a port its container names, and the probes ask that port.
    service = next(d for _, d in docs if d["kind"] == "Service")
    planner = next(pod for _, d, pod in pod_specs(docs) if d["kind"] == "StatefulSet")
    ports = {p["name"]: p["containerPort"] for p in planner["containers"][0]["ports"]}
    for p in service["spec"]["ports"]:
        assert p["targetPort"] in ports, (p, ports)
    for probe in ("readinessProbe", "livenessProbe"):
        assert planner["containers"][0][probe]["grpc"]["port"] in ports.values()
    listen = next(a for a in planner["containers"][0]["args"] if a.startswith("--listen="))
    assert listen.endswith(f":{service['spec']['ports'][0]['port']}")
    # The daemon's socket lies in the host directory the training pods mount, at the path
    # they are given.
    daemon = next(pod for _, d, pod in pod_specs(docs) if d["kind"] == "DaemonSet")
    job = next(pod for _, d, pod in pod_specs(docs) if d["kind"] == "Job")
    sock = next(a.split("=", 1)[1] for a in daemon["containers"][0]["args"]
                if a.startswith("--socket="))
    sockets = next(a.split("=", 1)[1] for a in job["containers"][0]["args"]
                   if a.startswith("--sockets="))
    assert sockets == sock

    def host_dir(pod, mount_path):
        mount = next(m for c in pod["containers"] for m in c["volumeMounts"]
                     if m["mountPath"] == mount_path)
        return next(v for v in pod["volumes"] if v["name"] == mount["name"])["hostPath"]["path"]
    assert host_dir(daemon, os.path.dirname(sock)) == host_dir(job, os.path.dirname(sock))
    assert daemon.get("hostIPC") and job.get("hostIPC")


def test_slurm_script_and_container_recipe_name_what_exists():
    script = os.path.join(DEPLOY, "slurm", "ragshard.sbatch")
    assert subprocess.run(["bash", "-n", script]).returncode == 0
    text = open(script).read().replace("\\\n", " ")
    for program in ("ragshard-planner", "ragshardd", "ragshardctl"):
        assert f"$bin/{program}" in text or f'"$bin/{program}"' in text, program
    daemon = re.search(r'exec "\$0" (.*?)\'', text, re.S)[1]  # ragshardd's flags
    check_flags("ragshardd", daemon.split())
    check_flags("ragshard-planner", re.search(r'"\$bin/ragshard-planner" ([^&]*)&', text)[1]
                .split())
    ctl = re.search(r'"\$bin/ragshardctl" ([^\n]*)', text)[1].split()
    assert ctl[2:4] == ["job", "create"], ctl
    check_flags("ragshardctl", ctl, ["job", "create"])
    recipe = open(os.path.join(DEPLOY, "container", "Dockerfile")).read()
    for src in re.findall(r"^COPY (?!--from)(\S+) ", recipe, re.M):
        assert os.path.exists(os.path.join(ROOT, src)), src
