"""Sections one script owns inside a report that another script renders: bench/chaos_hosts.py
writes its host-fault figures into docs/benchmarks/recovery.md and reliability.md, which
bench/recovery_render.py and bench/chaos_render.py write as a whole; their renders carry the
sections over unchanged, so either script can run again without losing the other's figures.

A section is the text between its two marker lines:

    <!-- section NAME (OWNER): other renders keep it -->
    ...
    <!-- end of section NAME -->
"""
import re

_BLOCK = re.compile(r"<!-- section (?P<name>[\w-]+) \([^)]*\): other renders keep it -->\n"
                    r".*?<!-- end of section (?P=name) -->\n?", re.S)


def block(name, owner, text):
    """The section's text between its markers."""
    return (f"<!-- section {name} ({owner}): other renders keep it -->\n"
            f"{text.rstrip()}\n<!-- end of section {name} -->\n")


def put(path, name, owner, text):
    """Writes section `name` of the report at `path`: in place of the one there, else at its
    end."""
    with open(path) as f:
        old = f.read()
    new = block(name, owner, text)
    found = [m for m in _BLOCK.finditer(old) if m.group("name") == name]
    if found:
        m = found[0]
        old = old[:m.start()] + new + old[m.end():]
    else:
        old = old.rstrip("\n") + "\n\n" + new
    with open(path, "w") as f:
        f.write(old)


def carried(path):
    """The sections of the report at `path` now, for a render that rewrites the rest ("" when
    it has none or does not exist)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return ""
    return "\n".join(m.group(0).rstrip("\n") + "\n" for m in _BLOCK.finditer(text))
