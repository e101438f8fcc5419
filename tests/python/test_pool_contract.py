"""The contract between the daemon and the training processes about a rank's state buffers in
the pool (their names, the step journal's layout) is defined once, in protocol/pool_contract.h,
and the Python side reads it through the C library (ragshard._pool). This test fails where a
source of either side spells a name of its own: a string literal that starts with one of the
contract's prefixes, in Python (python/ragshard) or C++ (server/, client/, protocol/, python/),
outside the contract itself; and where the Python side's view of the contract differs from the
header's constants."""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

from ragshard import _pool  # noqa: E402

CONTRACT = os.path.join("protocol", "pool_contract.h")
PREFIXES = [_pool.SHARD, _pool.JOURNAL, _pool.OPTIMIZER, _pool.SHRINK, _pool.COPY]


def sources(folders, suffixes):
    for folder in folders:
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(suffixes):
                    yield os.path.relpath(os.path.join(dirpath, f), ROOT)


def spelled(path, python):
    """(line number, literal) of each string literal of `path` (code, not comments or
    docstrings' prose) that starts with a contract prefix."""
    # A literal opening: a quote (after an f/b/r prefix in Python), then a prefix.
    quote = r"""(?:\b[fFrRbB]{0,2})?["']""" if python else r'"'
    pattern = re.compile(quote + "(" + "|".join(re.escape(p) for p in PREFIXES) + ")")
    out = []
    in_doc = False
    for n, line in enumerate(open(os.path.join(ROOT, path), encoding="utf-8"), 1):
        code = line.split("#")[0] if python else line.split("//")[0]
        if python and code.count('"""') % 2 == 1:
            in_doc = not in_doc
            continue
        if in_doc or (python and '"""' in code):
            continue
        for m in pattern.finditer(code):
            out.append((n, code.strip()))
    return out


def test_no_source_spells_a_pool_name_of_its_own():
    found = []
    for path in sources(["python/ragshard"], (".py",)):
        found += [f"{path}:{n}: {text}" for n, text in spelled(path, python=True)]
    for path in sources(["server", "client", "protocol", "python"], (".cc", ".h", ".cu")):
        if path.startswith(os.path.join("protocol", "pool_contract")):
            continue
        found += [f"{path}:{n}: {text}" for n, text in spelled(path, python=False)]
    assert not found, ("pool names spelled outside protocol/pool_contract.h (use its constants, "
                       "or ragshard._pool in Python):\n" + "\n".join(found))


def test_the_python_side_reads_the_headers_constants():
    header = open(os.path.join(ROOT, CONTRACT)).read()
    constants = dict(re.findall(r'inline constexpr char (k\w+)\[\] = "([^"]*)";', header))
    numbers = {k: int(v) for k, v in re.findall(r"inline constexpr int (k\w+) = (\d+);", header)}
    assert constants["kShard"] == _pool.SHARD and constants["kJournal"] == _pool.JOURNAL
    assert constants["kOptimizer"] == _pool.OPTIMIZER and constants["kShrink"] == _pool.SHRINK
    assert constants["kCopy"] == _pool.COPY
    assert constants["kJournalMeta"] == _pool.JOURNAL_META
    assert constants["kShrinkInPlace"] == _pool.SHRINK_IN_PLACE
    assert _pool.copy(3, _pool.COPY_DIRECTORY) == \
        f"{constants['kCopy']}3/{constants['kCopyDirectory']}"
    assert (_pool.JOURNAL_META_FIELDS, _pool.COMMITTED, _pool.BEGUN, _pool.BASE,
            _pool.BASE_BEFORE) == \
        (numbers["kJournalMetaFields"], numbers["kJournalCommitted"], numbers["kJournalBegun"],
         numbers["kJournalBase"], numbers["kJournalBaseBefore"])


def test_every_name_of_the_header_reaches_the_python_side():
    """A name added to the header but not to the contract the C library hands Python
    (PoolContractJson) fails here, and so does one the library hands on that the header lacks."""
    header = open(os.path.join(ROOT, CONTRACT)).read()
    in_header = set(re.findall(r'inline constexpr char k\w+\[\] = "([^"]*)";', header))
    in_python = set(_pool._PREFIXES.values()) | set(_pool._NAMES.values())
    assert in_header == in_python, (f"only in {CONTRACT}: {sorted(in_header - in_python)}; only "
                                    f"in PoolContractJson: {sorted(in_python - in_header)}")
    numbers = re.findall(r"inline constexpr int (k\w+) = (\d+);", header)
    assert len(numbers) == len(_pool._CONTRACT["journal_meta"]), numbers
