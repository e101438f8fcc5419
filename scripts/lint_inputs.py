"""What scripts/lint.sh checks, and what each check's result depends on.

    python3 scripts/lint_inputs.py BUILD_DIR list             the sources to lint, one a line
    python3 scripts/lint_inputs.py BUILD_DIR keys FILE...     "KEY FILE" a line

A source's key is a SHA-256 over what clang-tidy's findings on it depend on: the
clang-tidy version, .clang-tidy, the source's compile command (the checkout's and the build
folder's paths taken out), and each file its compilation read (`ninja -t deps` of its object:
the checkout's sources and headers and the build's generated ones by content, the system's by
path: their contents change only with a package update, after which lint.sh --all). A source whose object the build has not compiled (no deps recorded) gets no key,
so it is always linted. .ci/lint-clean.txt records the keys of sources found clean; lint.sh
lints again every source whose key is not there (docs/testing.md, "Lint").
"""
import hashlib
import json
import os
import re
import subprocess
import sys

WANTED = re.compile(r"^(infra|engine|protocol|client|ctl|server)/.*\.cc$"
                    r"|^python/ragshard_c(_abi|_local)?\.cc$")


def entries(build, root):
    """{source: (command, object)} of the compile database, for the sources lint.sh checks."""
    out = {}
    for e in json.load(open(os.path.join(build, "compile_commands.json"))):
        path = os.path.relpath(os.path.join(e["directory"], e["file"]), root)
        if WANTED.match(path) and path not in out:
            m = re.search(r"\s-o\s+(\S+)", e["command"])
            out[path] = (e["command"], m.group(1) if m else None)
    return out


def deps(build, obj):
    """The files the compilation of `obj` read, or None where ninja has none recorded."""
    r = subprocess.run(["ninja", "-C", build, "-t", "deps", obj], capture_output=True,
                       text=True)
    if r.returncode != 0 or "(VALID)" not in r.stdout.split("\n", 1)[0]:
        return None
    return [line.strip() for line in r.stdout.split("\n")[1:] if line.strip()]


def key(build, root, command, obj, tidy_version, config):
    files = deps(build, obj) if obj else None
    if not files:
        return None
    h = hashlib.sha256()
    build_abs = os.path.abspath(build)
    for part in (tidy_version, config,
                 command.replace(build_abs, "<build>").replace(root, "<root>")):
        h.update(part.encode() + b"\0")
    parts = []
    for f in files:
        path = os.path.abspath(os.path.join(build, f))
        if path.startswith(root + os.sep):
            try:
                data = open(path, "rb").read()
            except OSError:
                return None
            where = "<build>" + path[len(build_abs):] if path.startswith(build_abs + os.sep) \
                else "<root>" + path[len(root):]
            parts.append(f"{where} {hashlib.sha256(data).hexdigest()}")
        else:
            parts.append(path)  # a system header: by path (a package update keeps the key)
    for part in sorted(parts):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def main():
    build, what, files = sys.argv[1], sys.argv[2], sys.argv[3:]
    root = os.path.abspath(os.getcwd())
    found = entries(build, root)
    if what == "list":
        print("\n".join(found))
        return
    version = subprocess.run(["clang-tidy", "--version"], capture_output=True,
                             text=True).stdout
    config = open(os.path.join(root, ".clang-tidy")).read()
    for f in files:
        command, obj = found[f]
        k = key(build, root, command, obj, version, config)
        print(f"{k or '-'} {f}")


if __name__ == "__main__":
    main()
