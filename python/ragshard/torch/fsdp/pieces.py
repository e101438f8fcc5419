"""This rank's pieces of a ShardedModule's parameters, in tensor coordinates.

A rank's optimizer range of a unit is position `ospos` of the os layout with S_os elements
(the whole parameter shard, position `pos`, when p = g = os): the unit's flat elements
[ospos*S_os, (ospos+1)*S_os); a parameter at [off, off + numel) of the unit therefore has its
flat elements [max(off, ospos*S_os) - off, min(off + numel, (ospos+1)*S_os) - off) there. These
ranges come from the plan (the module's pieces). Checkpoints store them, and optimizers whose
state is blocked in tensor coordinates (8-bit Adam) check their blocks against them.
"""
import collections

# A piece of one parameter in this rank's optimizer range: the parameter's name, shape and index,
# its unit, the range's elements [lo, hi) and the parameter's flat elements
# [start, start + hi - lo).
Piece = collections.namedtuple("Piece", "name shape index unit lo hi start matrix")


def tensor_pieces(model):
    """This rank's pieces of every parameter of `model` (a ShardedModule, or its RankShards:
    what this module reads of either is units(), unit_params, unit_views, param_index, pieces,
    ospos and os_elems; and shard and master_of below), in unit order."""
    out = []
    for ui in model.units():
        base = model.ospos * model.os_elems[ui]
        by_index = {}
        for (name, p), (_, off, _) in zip(model.unit_params(ui), model.unit_views(ui)):
            by_index[model.param_index(p)] = (name, tuple(p.shape), off)
        for pc in model.pieces(ui):
            name, shape, off = by_index[pc.index]
            out.append(Piece(name, shape, pc.index, ui, pc.lo, pc.hi, base + pc.lo - off,
                             pc.matrix))
    return out


def param_values(model, pc):
    """The exact values of piece `pc`: the fp32 master where the module keeps one (bf16
    parameters, quantized gathers), else the parameter shard."""
    shard, _ = model.shard(pc.unit)
    master = model.master_of(pc.unit)
    return (shard if master is None else master)[pc.lo:pc.hi]


def set_param_values(model, pc, values):
    """Writes `values` (any float dtype) into piece `pc`: the fp32 master and the shard."""
    shard, _ = model.shard(pc.unit)
    master = model.master_of(pc.unit)
    if master is not None:
        master[pc.lo:pc.hi].copy_(values.to(master.dtype))
    shard[pc.lo:pc.hi].copy_(values.to(shard.dtype))
