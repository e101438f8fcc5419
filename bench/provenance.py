"""Which commit a report's figures come from (issue 51, item 6): every report script refuses a
dirty tree unless given --allow-dirty, and writes under its report's title

    commit: <40-hex HEAD> (clean)            or  commit: <40-hex HEAD> (dirty: <paths>)
    date: <when the run started>

Dirty: `git status --porcelain` lists the path (changed, staged, or untracked and not
ignored); files git ignores do not count."""
import datetime
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHOWN = 3  # dirty paths named in the header; the rest counted


def _git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True,
                          check=True, timeout=60).stdout


def dirty_paths():
    """The paths `git status` reports, ignored files left out."""
    items, paths = _git("status", "--porcelain=v1", "-z").split("\0"), []
    i = 0
    while i < len(items):
        entry, i = items[i], i + 1
        if entry:
            paths.append(entry[3:])
            i += entry[0] in "RC"  # a rename or copy: its source path follows
    return paths


def state(paths=None):
    """`<40-hex HEAD> (clean)` or `<40-hex HEAD> (dirty: a, b, c and N more)`."""
    paths = dirty_paths() if paths is None else paths
    head = _git("rev-parse", "HEAD").strip()
    if not paths:
        return f"{head} (clean)"
    more = f" and {len(paths) - SHOWN} more" if len(paths) > SHOWN else ""
    return f"{head} (dirty: {', '.join(paths[:SHOWN])}{more})"


def lines(commit_state, date):
    """The header's markdown lines."""
    return [f"commit: {commit_state}", "", f"date: {date}"]


def add_flag(ap):
    ap.add_argument("--allow-dirty", action="store_true",
                    help="run on a tree with uncommitted changes; the report's header then "
                         "says `commit: HEAD (dirty: ...)`")


def require(args):
    """Exits 2 on a dirty tree unless args.allow_dirty; else sets and returns
    args.provenance, the header's lines (taken now, before the run writes anything)."""
    paths = dirty_paths()
    if paths and not args.allow_dirty:
        print(f"{os.path.basename(sys.argv[0])}: the tree has uncommitted changes, so the "
              "report could not name the commit its figures come from:\n  "
              + "\n  ".join(paths) + "\ncommit them, or run again with --allow-dirty "
              "(the header then says dirty)", file=sys.stderr)
        sys.exit(2)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    args.provenance = lines(state(paths), when)
    return args.provenance


def _is_header(line):
    return not line.strip() or line.startswith(("commit: ", "date: "))


def stamp(text, header, heading=None):
    """`text` with `header` (lines) right under `heading` (default: the first `# ` title),
    replacing a header already there."""
    rows = text.split("\n")
    at = next((i for i, r in enumerate(rows)
               if (r == heading if heading else r.startswith("# "))), None)
    if at is None:
        return "\n".join(header + [""] + rows)
    end = at + 1
    while end < len(rows) and _is_header(rows[end]):
        end += 1
    return "\n".join(rows[:at + 1] + [""] + header + [""] + rows[end:])


def kept(path, heading=None):
    """The header lines under `heading` in the report at `path` now (for a re-render from
    figures that did not record their commit), or None."""
    try:
        rows = open(path).read().split("\n")
    except OSError:
        return None
    at = next((i for i, r in enumerate(rows)
               if (r == heading if heading else r.startswith("# "))), None)
    if at is None:
        return None
    end = at + 1
    while end < len(rows) and _is_header(rows[end]):
        end += 1
    found = [r for r in rows[at + 1:end] if r.strip()]
    return [x for r in found for x in ("", r)][1:] or None


def restamp(path, header, heading=None):
    """Stamps the report at `path` as it is (after a script rewrote one of its sections)."""
    with open(path) as f:
        text = f.read()
    write(path, text, header, heading)


def write(path, text, header, heading=None):
    """Writes `text` to `path`, stamped with `header`; with header None, with the one the file
    has now."""
    header = header if header is not None else kept(path, heading)
    with open(path, "w") as f:
        f.write(stamp(text, header, heading) if header else text)
