"""Reads the Prometheus endpoints of a planner and of daemons (`--metrics-listen`).

    series = scrape("http://127.0.0.1:9464/metrics")
    for name, labels, value in nonzero(series):
        print(format_series(name, labels, value))

The servers' own series are named `ragshard_planner_*` and `ragshard_daemon_*`; the
`exposer_*` series are prometheus-cpp's.
"""
import re
import urllib.request

_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text):
    """The samples of a Prometheus text exposition: [(name, {label: value}, float)]."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def scrape(url, timeout=10.0):
    """Fetches and parses `url` (http://HOST:PORT/metrics)."""
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return parse(r.read().decode())


def nonzero(series, prefix="ragshard_"):
    """The samples of our own series (`prefix`) whose value is not 0 (NaN excluded)."""
    return [(n, l, v) for n, l, v in series if n.startswith(prefix) and v == v and v != 0]


def format_series(name, labels, value):
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    shown = int(value) if value == int(value) else value
    return f"{name}{{{inner}}} {shown}" if inner else f"{name} {shown}"
