"""ragshard._jobs: the planner's job calls (create, delete, describe a job) and the redundancy
spelling rules, through the C library (ragshard._core)."""
import ctypes
import json

from ._core import _b, _check, _lib, _security, _string


def redundancy(text, nodes=0, field="redundancy"):
    """A job's redundancy across nodes as the planner and the daemon read it (the C library's
    rules, engine/redundancy.h): {"name": its canonical spelling, "whole_copies": whether it holds
    each node's state whole on another node, "min_nodes", "group": parity:K's K + 1 (else 0),
    "nodes_error": why it cannot run on `nodes` nodes, or "" (`nodes` 0: not asked)}. ValueError
    naming `field` for a spelling that is none of them."""
    return json.loads(_string(_lib.rs_redundancy, _b(field), _b(text or ""), int(nodes)))


def create_job(planner, job, shard_size, replicate_size=1, policy="ragged", default_granule="",
               token_file="", strategy="", memory_budget_bytes=0, optimizer="",
               tokens_per_step=0, tls_ca=None, tls_cert=None, tls_key=None,
               tls_server_name=None, recovery_deadline_ms=0, redundancy="", on_node_loss=""):
    """Creates a job (ALREADY_EXISTS is an error too: the caller decides); returns its id. The
    token and TLS options are Client's. `recovery_deadline_ms` > 0: a lost rank process is
    recovered in place within that many ms (docs/recovery.md). `redundancy`: "" (none),
    "parity:K" or "replica": a lost node is rebuilt on a replacement daemon (docs/recovery.md,
    "A lost node"; it needs a recovery deadline). `on_node_loss` "shrink": a node lost without a
    replacement shrinks the job to the other nodes' ranks (docs/recovery.md, "Shrinking in
    place")."""
    if int(recovery_deadline_ms) < 0:
        raise ValueError(f"recovery_deadline_ms: {recovery_deadline_ms} must not be negative")
    security = _security(token_file, tls_ca, tls_cert, tls_key, tls_server_name)
    return _string(_lib.rs_create_job_secure, _b(planner), _b(job), int(shard_size),
                   int(replicate_size), _b(policy), _b(default_granule), ctypes.byref(security),
                   _b(strategy), int(memory_budget_bytes), _b(optimizer), int(tokens_per_step),
                   int(recovery_deadline_ms), _b(redundancy or ""), _b(on_node_loss or ""))


def delete_job(planner, job, token_file="", tls_ca=None, tls_cert=None, tls_key=None,
               tls_server_name=None):
    security = _security(token_file, tls_ca, tls_cert, tls_key, tls_server_name)
    _check(_lib.rs_delete_job_secure(_b(planner), _b(job), ctypes.byref(security)))


def job_world_size(planner, job, token_file="", tls_ca=None, tls_cert=None, tls_key=None,
                   tls_server_name=None):
    """The world size of an existing job (Error NOT_FOUND where there is none)."""
    out = ctypes.c_int64(0)
    security = _security(token_file, tls_ca, tls_cert, tls_key, tls_server_name)
    _check(_lib.rs_job_world_size_secure(_b(planner), _b(job), ctypes.byref(security),
                                         ctypes.byref(out)))
    return out.value


def job_info(planner, job, token_file="", tls_ca=None, tls_cert=None, tls_key=None,
              tls_server_name=None):
    """The job as the planner answers GetJob, a dict with the proto's field names (int64 values
    as numbers here): its status ("JOB_SHRUNK", ...), and a shrunk job's successor_job_id and
    survivor_ranks. Error NOT_FOUND where there is none."""
    security = _security(token_file, tls_ca, tls_cert, tls_key, tls_server_name)
    job = json.loads(_string(_lib.rs_job_json, _b(planner), _b(job), ctypes.byref(security)))
    job["survivor_ranks"] = [int(r) for r in job.get("survivor_ranks", [])]
    for key in ("world_size", "shrinks", "recovery_epoch"):
        job[key] = int(job.get(key, 0))
    return job
