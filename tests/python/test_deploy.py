"""The deploy/ manifests are checked: the systemd units pass `systemd-analyze verify` (with the
programs' paths pointed at this build), the Kubernetes manifests parse and hang together, and
every program, flag, port, volume and secret they name exists: each flag in the program's own
--help, each volume mounted declared, each Service port a container's port. The container recipe
installs a Debian 12 package for every dependency of the build and every library the programs
load, and the daemon it runs has the backend its image was built with."""
import functools
import os
import re
import shutil
import subprocess
import sysconfig
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
DEPLOY = os.path.join(ROOT, "deploy")
PROGRAMS = {"ragshard-planner": [os.path.join(BUILD, "server", "ragshard-planner")],
            "ragshardd": [os.path.join(BUILD, "server", "ragshardd")],
            "ragshardctl": [os.path.join(BUILD, "ctl", "ragshardctl")],
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
        # TLS: the kubelet's gRPC probes speak plaintext, so `ragshardctl health` asks the port.
        command = planner["containers"][0][probe]["exec"]["command"]
        assert command[0] == "ragshardctl" and command[-1] == "health", command
        check_flags("ragshardctl", command[1:-1])
        asked = next(a for a in command if a.startswith("--planner="))
        assert int(asked.rsplit(":", 1)[1]) in ports.values(), command
    # The planner serves TLS only, and its clients are given its CA.
    args = planner["containers"][0]["args"]
    assert "--insecure" not in args and any(a.startswith("--tls-cert=") for a in args), args
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
    for pod in (daemon, job):
        assert any(a.startswith("--tls-ca=") for a in pod["containers"][0]["args"])

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


# -- The container recipe (deploy/container/Dockerfile) against the build and Debian 12 ---------
# Base images cannot be pulled here, so no image is built: its recipe is checked instead.

DOCKERFILE = os.path.join(DEPLOY, "container", "Dockerfile")
MULTIARCH = sysconfig.get_config_var("MULTIARCH") or "x86_64-linux-gnu"
LIB = f"/usr/lib/{MULTIARCH}"

# Each find_package / pkg_check_modules name of the build: the Debian 12 packages that provide it,
# each with a file of it that the build uses (checked with `dpkg -S` where the build ran), or,
# for a name the image's build does not need, why not (checked against the CMake files).
DEBIAN = {
    "Threads": {"libc6-dev": "/usr/include/pthread.h"},
    "OpenSSL": {"libssl-dev": f"{LIB}/libssl.so"},
    "SQLite3": {"libsqlite3-dev": f"{LIB}/libsqlite3.so"},
    "Protobuf": {"libprotobuf-dev": f"{LIB}/libprotobuf.so",
                 "protobuf-compiler": "/usr/bin/protoc"},
    "gRPC": {"libgrpc-dev": f"{LIB}/cmake/grpc/gRPCConfig.cmake",
             "libgrpc++-dev": f"{LIB}/libgrpc++.so",
             "protobuf-compiler-grpc": "/usr/bin/grpc_cpp_plugin"},
    "absl": {"libabsl-dev": f"{LIB}/cmake/absl/abslConfig.cmake"},
    "glog": {"libgoogle-glog-dev": f"{LIB}/cmake/glog/glog-config.cmake"},
    "nlohmann_json": {"nlohmann-json3-dev":
                      "/usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake"},
    "CLI11": {"libcli11-dev": "/usr/share/cmake/CLI11/CLI11Config.cmake"},
    "prometheus-cpp": {"prometheus-cpp-dev":
                       f"{LIB}/cmake/prometheus-cpp/prometheus-cpp-config.cmake"},
    "PkgConfig": {"pkgconf": "/usr/bin/pkg-config"},
    "ucx": {"libucx-dev": f"{LIB}/pkgconfig/ucx.pc"},  # pkg_check_modules: the module's name
    "libzstd": {"libzstd-dev": f"{LIB}/pkgconfig/libzstd.pc"},
    "libisal": {"libisal-dev": f"{LIB}/pkgconfig/libisal.pc"},
    "ZLIB": {"zlib1g-dev": f"{LIB}/libz.so"},
    # The interpreter CMake finds is the build's venv (python3 -m venv): python3-venv is a
    # package of dependencies only (python3, python3.11-venv), with no file of its own to name.
    "Python": {"python3-venv": None},
    "GTest": "the tests: RAGSHARD_BUILD_TESTS is OFF in the wheel's build (pyproject.toml)",
    "MPI": "a benchmark, optional (QUIET): RAGSHARD_BUILD_BENCH is OFF in the wheel's build",
    "Gloo": "a benchmark, optional (QUIET): RAGSHARD_BUILD_BENCH is OFF in the wheel's build",
    "CUDAToolkit": "the GPU backend: the image's build sets RAGSHARD_WITH_CUDA=OFF",
}

# Libraries the runtime stage need not install: the debian:12 image's own (dependencies of dpkg
# and apt, which every Debian image has and the recipe runs), checked below to be so.
BASE_IMAGE = {"libc6": "the C library and the dynamic loader",
              "libgcc-s1": "GCC's runtime (libgcc_s)",
              "libstdc++6": "the C++ standard library",
              "liblzma5": "xz, which dpkg itself needs"}


def stages(text):
    """The recipe's stages: {name (or its index), [packages apt-get installs]}, and the text of
    each stage's commands, continuation lines joined."""
    text = text.replace("\\\n", " ")
    out, name = {}, None
    for i, part in enumerate(re.split(r"^FROM ", text, flags=re.M)[1:]):
        head = part.splitlines()[0].split()
        name = head[2] if len(head) >= 3 and head[1].upper() == "AS" else str(i)
        pkgs = []
        for cmd in re.findall(r"apt-get install ([^&\n]*)", part):
            pkgs += [w for w in cmd.split() if not w.startswith("-")]
        out[name] = (pkgs, part)
    return out


def build_and_runtime(text):
    s = stages(text)
    return s["build"], s[list(s)[-1]]


@functools.lru_cache(maxsize=None)
def cmake_calls():
    """(file, command, name, args) of every find_package / pkg_check_modules of the build, with
    the if() conditions around it and around the add_subdirectory that reaches its file."""
    files = [os.path.join(ROOT, "CMakeLists.txt")]
    files += sorted(os.path.join(ROOT, "cmake", f) for f in os.listdir(os.path.join(ROOT, "cmake"))
                    if f.endswith(".cmake"))
    gates = {ROOT: []}  # a directory: the conditions its add_subdirectory lies under
    calls, i = [], 0
    while i < len(files):
        path = files[i]
        i += 1
        here = os.path.dirname(path)
        outer = gates.get(here, [])
        stack = []
        text = re.sub(r"#[^\n]*", "", open(path).read())
        for m in re.finditer(r"\b(if|endif|add_subdirectory|find_package|pkg_check_modules)"
                             r"\s*\(([^)]*)\)", text, re.I):
            cmd, args = m[1].lower(), m[2].split()
            if cmd == "if":
                stack.append(" ".join(args))
            elif cmd == "endif":
                stack.pop()
            elif cmd == "add_subdirectory":
                sub = os.path.join(here, args[0])
                gates[sub] = outer + stack
                files.append(os.path.join(sub, "CMakeLists.txt"))
            else:
                name = args[0] if cmd == "find_package" else \
                    next(a for a in args[1:] if a not in ("REQUIRED", "QUIET", "IMPORTED_TARGET"))
                calls.append((os.path.relpath(path, ROOT), cmd, name, args, outer + stack))
    return calls


def image_defines(dockerfile_text):
    """The CMake definitions of the image's build: pyproject.toml's, then the recipe's."""
    defines = {}
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        section = False
        for line in f:
            if line.startswith("["):
                section = line.strip() == "[tool.scikit-build.cmake.define]"
            elif section and "=" in line:
                k, v = line.split("=", 1)
                defines[k.strip()] = v.strip().strip('"')
    defines.update(re.findall(r"cmake\.define\.(\w+)=(\S+)", dockerfile_text))
    return defines


def off_in_image(condition, defines):
    """Whether an if() condition is false in the image's build (only the forms the build uses
    for its options; anything else counts as true)."""
    m = re.fullmatch(r"(\w+)", condition)
    if m and defines.get(m[1], "").upper() == "OFF":
        return True
    m = re.fullmatch(r'NOT (\w+) STREQUAL "?(\w+)"?', condition)
    return bool(m and defines.get(m[1], "").upper() == m[2].upper())


def required_build_packages(dockerfile_text, table=DEBIAN):
    """The Debian packages the image's build needs, from the CMake files and the table; every
    name the table does not map, or maps to a reason that does not hold, is an error."""
    defines = image_defines(dockerfile_text)
    needed, errors = {}, []
    for path, cmd, name, args, gates in cmake_calls():
        if name not in table:
            errors.append(f"{path}: {cmd}({name}) has no Debian package in test_deploy.DEBIAN")
            continue
        in_image = not any(off_in_image(g, defines) for g in gates)
        if isinstance(table[name], str):
            if in_image and "REQUIRED" in args:
                errors.append(f"{path}: {cmd}({name}) is REQUIRED in the image's build, but "
                              f"the table says '{table[name]}'")
            continue
        if in_image:
            needed.update({p: name for p in table[name]})
    return needed, errors


def missing_from_build_stage(dockerfile_text, table=DEBIAN):
    needed, errors = required_build_packages(dockerfile_text, table)
    (installed, _), _ = build_and_runtime(dockerfile_text)
    return errors + [f"the build stage does not install {p} ({name})"
                     for p, name in sorted(needed.items()) if p not in installed]


def without(text, package):
    """The recipe with `package` taken out of its apt-get lines (one word, wherever it is)."""
    out = re.sub(rf"(?<=\s){re.escape(package)}(?=\s)", "", text)
    assert out != text, package
    return out


def apt_simulate(packages):
    return subprocess.run(["apt-get", "install", "--simulate", "--no-install-recommends",
                           *packages], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, LC_ALL="C"))


def dpkg_owner(paths):
    """{path: package} for each path dpkg knows (merged /usr: a path is also tried without or
    with its /usr prefix, since packages name /lib/... or /usr/lib/...)."""
    tries = {}
    for p in paths:  # the path itself first: a symlink (libssl.so) has a package of its own
        for q in dict.fromkeys([p, os.path.realpath(p)]):
            tries.setdefault(p, []).append(q)
            tries[p].append(q[4:] if q.startswith("/usr/") else "/usr" + q)
    r = subprocess.run(["dpkg", "-S", *sorted({q for qs in tries.values() for q in qs})],
                       capture_output=True, text=True, timeout=60)
    owner = {}
    for line in r.stdout.splitlines():
        if line.startswith("diversion "):
            continue
        pkgs, path = line.split(": ", 1)
        owner[path] = pkgs.split(", ")[0].split(":")[0]
    return {p: next((owner[q] for q in qs if q in owner), None) for p, qs in tries.items()}


def debian12():
    try:
        return open("/etc/debian_version").read().startswith("12")
    except OSError:
        return False


@pytest.mark.skipif(shutil.which("dpkg") is None or shutil.which("apt-get") is None,
                    reason="dpkg and apt-get are not installed (not a Debian machine)")
def test_container_build_stage_installs_each_dependency_of_the_build():
    recipe = open(DOCKERFILE).read()
    assert missing_from_build_stage(recipe) == []
    needed, _ = required_build_packages(recipe)
    assert "libzstd-dev" in needed and "libgtest-dev" not in needed, needed
    # The table is true where the build ran: each package owns the file the build used.
    probes = {f: p for name in DEBIAN if isinstance(DEBIAN[name], dict)
              for p, f in DEBIAN[name].items() if f is not None}
    owners = dpkg_owner(probes)
    for f, p in probes.items():
        assert owners[f] == p, f"{f} belongs to {owners[f]}, not {p} (test_deploy.DEBIAN)"
    # Each package removed from the recipe is named missing; the unmapped name too.
    for p in needed:
        assert any(p in m for m in missing_from_build_stage(without(recipe, p))), p
    unmapped = {k: v for k, v in DEBIAN.items() if k != "libzstd"}
    assert "pkg_check_modules(libzstd) has no Debian package" in \
        "\n".join(missing_from_build_stage(recipe, unmapped))
    # A reason that does not hold (GTest is REQUIRED where the image builds the tests) too.
    tests_on = recipe.replace("RAGSHARD_WITH_CUDA=OFF",
                              "RAGSHARD_WITH_CUDA=OFF --config-settings=cmake.define."
                              "RAGSHARD_BUILD_TESTS=ON")
    assert "find_package(GTest) is REQUIRED in the image's build" in \
        "\n".join(missing_from_build_stage(tests_on))
    # Debian 12 (the base image's suite) has all of them, both stages' lists.
    if not debian12():
        pytest.skip("apt-get --simulate needs Debian 12's package lists (this is not Debian 12)")
    (build, _), (runtime, _) = build_and_runtime(recipe)
    for stage, pkgs in (("build", build), ("runtime", runtime)):
        r = apt_simulate(pkgs)
        assert r.returncode == 0, f"{stage} stage: apt-get install --simulate: {r.stderr}"
    assert apt_simulate(["libgoogle-glog1"]).returncode != 0  # a name bookworm lacks fails


def runtime_libraries():
    programs = [os.path.join(BUILD, "server", "ragshard-planner"),
                os.path.join(BUILD, "server", "ragshardd"),
                os.path.join(BUILD, "ctl", "ragshardctl"),
                os.path.join(BUILD, "python", "ragshard", "libragshard_c.so")]
    libs = {}
    for prog in programs:
        r = subprocess.run(["ldd", prog], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        for line in r.stdout.splitlines():
            m = re.match(r"\s*(\S+) => (\S+)", line) or re.match(r"\s*(/\S+)", line)
            if m and m.lastindex == 2 and m[2] == "not":
                pytest.fail(f"{prog}: {line.strip()}")
            if m:
                libs.setdefault(m[m.lastindex], set()).add(os.path.basename(prog))
    return libs


def missing_from_runtime_stage(dockerfile_text, owners):
    _, (installed, _) = build_and_runtime(dockerfile_text)
    return sorted(f"{lib}: {pkg} is not installed by the runtime stage" for lib, pkg in
                  owners.items() if pkg not in installed and pkg not in BASE_IMAGE)


@pytest.mark.skipif(shutil.which("dpkg") is None or shutil.which("ldd") is None,
                    reason="dpkg and ldd are not installed (not a Debian machine)")
def test_container_runtime_stage_installs_each_library_the_programs_load():
    libs = runtime_libraries()
    owners = dpkg_owner(libs)
    unknown = [lib for lib, pkg in owners.items() if pkg is None]
    assert unknown == [], f"libraries of no Debian package (not in the image): {unknown}"
    recipe = open(DOCKERFILE).read()
    assert missing_from_runtime_stage(recipe, owners) == []
    # Each package removed from the runtime stage is named missing.
    _, (runtime, _) = build_and_runtime(recipe)
    for pkg in set(owners.values()) - set(BASE_IMAGE):
        assert any(pkg in m for m in missing_from_runtime_stage(without(recipe, pkg), owners)), pkg
    # The base image's libraries are the base image's: in the dependencies of dpkg and apt.
    r = subprocess.run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests",
                        "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances",
                        "dpkg", "apt"], capture_output=True, text=True, timeout=60)
    base = {ln.split(":")[0] for ln in r.stdout.splitlines() if not ln.startswith(" ")}
    assert set(BASE_IMAGE) <= base, set(BASE_IMAGE) - base


def test_container_daemon_runs_the_backend_its_image_has():
    recipe = open(DOCKERFILE).read()
    assert image_defines(recipe).get("RAGSHARD_WITH_CUDA") == "OFF"  # no nvcc in the build stage
    docs = manifests()
    daemon = next(pod for _, d, pod in pod_specs(docs) if d["kind"] == "DaemonSet")
    backend = next(a.split("=", 1)[1] for a in daemon["containers"][0]["args"]
                   if a.startswith("--backend="))
    assert backend in ("host", "auto"), f"daemon.yaml runs --backend={backend} on an image " \
        "built without CUDA (ragshardd would exit)"
