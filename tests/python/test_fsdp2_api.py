"""FSDP2's module API on a fully_shard module, in one process (a job of one rank): each unit's
submodule and the wrapped module get FSDPModule's methods (their classes become subclasses of
their own, as FSDP2's do); what ragshard cannot do is refused by name with what to use instead;
ragshard's hooks stay before and after the user's whenever those were registered; a hook that
itself unshards or reshards gets FSDP2's behaviour, not a deadlock; requires_grad may change at
any time. The training numbers of the same API are in test_fsdp2_cases.py."""
import os
import sys
import warnings

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("RAGSHARD_BUILD", os.path.join(ROOT, "build"))
sys.path.insert(0, os.path.join(BUILD, "python"))

import ragshard  # noqa: E402
import ragshard.torch as rt  # noqa: E402
from ragshard.cluster import LocalCluster  # noqa: E402
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy  # noqa: E402


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(BUILD, daemons=1, pool_bytes=64 << 20) as c:
        yield c


_JOBS = []


@pytest.fixture
def shard(cluster):
    """fully_shard of a fresh Net over a job of one rank of its own."""
    made = []

    def make(net=None, **kwargs):
        _JOBS.append(None)
        name = f"api-{len(_JOBS)}"
        ragshard.create_job(cluster.planner, name, 1)
        client = ragshard.Client(cluster.planner, cluster.sockets[0], name, 0,
                                 cluster.nodes[0], 30000)
        net = net or Net()
        model = rt.fully_shard(net, client, units=lambda m: list(m.layers), world=1, **kwargs)
        made.append(model)
        return net, model
    yield make
    for model in made:
        model.client.close()


def test_units_and_the_wrapped_module_have_fsdpmodules_methods(shard):
    net, model = shard()
    methods = ["unshard", "reshard", "set_requires_gradient_sync", "set_requires_all_reduce",
               "set_reshard_after_forward", "set_reshard_after_backward",
               "set_unshard_in_backward", "set_modules_to_forward_prefetch",
               "set_modules_to_backward_prefetch", "set_gradient_divide_factor",
               "set_reduce_scatter_divide_factor", "set_force_sum_reduction_for_comms",
               "set_is_last_backward", "set_post_optim_event",
               "set_allocate_memory_from_process_group_for_comm", "set_all_reduce_hook",
               "set_custom_all_gather", "set_custom_reduce_scatter"]
    for m in (model, net, net.layers[0]):
        for name in methods:
            assert callable(getattr(m, name)), (type(m).__name__, name)
    layer = net.layers[0]
    assert type(layer).__name__ == "ShardedLinear" and isinstance(layer, torch.nn.Linear)
    # Every public method of FSDP2's FSDPModule is there (torch 2.11's list).
    from torch.distributed.fsdp import FSDPModule
    public = [n for n in dir(FSDPModule) if not n.startswith("_") and
              callable(getattr(FSDPModule, n))]
    assert sorted(public) == sorted(methods), sorted(set(public) ^ set(methods))


def test_unshard_makes_parameters_readable_and_reshard_releases_them(shard):
    net, model = shard()
    w = net.layers[1].weight
    with pytest.raises(RuntimeError, match="used while its unit"):
        _ = w.sum()
    net.layers[1].unshard()
    expect = float(w.detach().sum())
    net.layers[1].reshard()
    with pytest.raises(RuntimeError, match="used while its unit"):
        _ = w.sum()
    handle = net.layers[1].unshard(async_op=True)
    assert isinstance(handle, rt.UnshardHandle)
    handle.wait()
    assert float(w.detach().sum()) == expect
    model(torch.ones(2, 8)).sum().backward()  # a forward after an unshard of its own
    # The root's own parameters: the head's.
    net.unshard()
    assert float(net.head.weight.detach().abs().sum()) > 0
    net.reshard()


def test_what_ragshard_cannot_do_is_refused_by_name(shard):
    net, model = shard()
    with pytest.raises(NotImplementedError, match="set_all_reduce_hook: ragshard's daemon runs "
                                                  "the HSDP all-reduce"):
        net.set_all_reduce_hook(lambda t: None)
    with pytest.raises(NotImplementedError, match="set_custom_all_gather: .*quantize="):
        net.layers[0].set_custom_all_gather(object())
    with pytest.raises(NotImplementedError, match="set_custom_reduce_scatter"):
        model.set_custom_reduce_scatter(object())
    with pytest.raises(TypeError, match="Tanh is not a unit"):
        net.layers[0].set_modules_to_forward_prefetch([torch.nn.Tanh()])
    with pytest.raises(ValueError, match="set_gradient_divide_factor: 0.0 is not a positive"):
        net.set_gradient_divide_factor(0)
    with pytest.raises(ValueError, match="reshard_after_forward: 'x' is not True"):
        net.layers[0].set_reshard_after_forward("x")
    with pytest.warns(FutureWarning, match="set_gradient_divide_factor instead"):
        net.layers[0].set_reduce_scatter_divide_factor(2.0)


@pytest.mark.parametrize("kwargs,match", [
    ({"mesh": object()}, "mesh= is FSDP2's process-group mesh"),
    ({"shard_placement_fn": lambda p: None}, "shard_placement_fn= .* granule="),
    ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.float16)},
     "param_dtype torch.float16 is not supported"),
    ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                        reduce_dtype=torch.bfloat16)},
     "reduces gradients in fp32 always"),
    ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16), "param_dtype": "fp32"},
     None),
])
def test_fully_shards_fsdp2_arguments(shard, kwargs, match):
    if match is None:  # a policy and the default param_dtype: the policy's
        _, model = shard(**kwargs)
        assert model.param_dtype == "bf16"
        return
    with pytest.raises(ValueError, match=match):
        shard(**kwargs)


def test_cpu_offload_is_what_the_host_backend_does(shard):
    _, model = shard(offload_policy=CPUOffloadPolicy(pin_memory=False))
    assert model.shard(0)[0].device.type == "cpu"


def test_hooks_registered_after_wrapping_come_after_the_unshard_and_before_the_reshard(shard):
    """Even with prepend=True, a user's forward pre-hook registered after fully_shard sees its
    unit's parameters, and a forward hook registered after sees them before the reshard; full
    backward pre-hooks see them in backward."""
    net, model = shard()
    layer = net.layers[1]
    seen = []

    def note(kind, t):
        seen.append((kind, float(t.detach().abs().sum())))  # reads every element
    layer.register_forward_pre_hook(lambda m, a: note("pre", m.weight), prepend=True)
    layer.register_forward_hook(lambda m, a, o: note("post", m.bias), prepend=True)
    layer.register_full_backward_pre_hook(lambda m, g: note("backward_pre", m.weight),
                                          prepend=True)
    model(torch.ones(2, 8)).sum().backward()
    assert [k for k, _ in seen] == ["pre", "post", "backward_pre"]
    with pytest.raises(RuntimeError, match="used while its unit"):
        _ = layer.weight.sum()


def test_a_hook_that_unshards_or_reshards_its_unit_does_not_deadlock(shard):
    """A user's hook may call its unit's unshard (already done: nothing happens) or reshard (the
    parameters go: the next use is the named error, not a hang)."""
    net, model = shard()
    layer = net.layers[0]
    h = layer.register_forward_pre_hook(lambda m, a: m.unshard())
    model(torch.ones(2, 8)).sum().backward()
    h.remove()
    h = layer.register_forward_pre_hook(lambda m, a: m.reshard())
    with pytest.raises(RuntimeError, match="'layers.0.weight' is used while its unit"):
        model(torch.ones(2, 8))
    h.remove()


def test_requires_grad_may_change_before_and_after_wrapping(shard):
    """A parameter frozen before fully_shard and unfrozen later gets a gradient and is stepped;
    one frozen later gets none and stays exactly as it was."""
    net = Net()
    net.layers[1].weight.requires_grad_(False)
    net, model = shard(net)
    opt = rt.ShardedOptimizer(model, torch.optim.AdamW, lr=0.1)

    def step():
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    before = model.full_state()
    step()
    after = model.full_state()
    assert torch.equal(after["layers.1.weight"], before["layers.1.weight"])
    net.layers[1].weight.requires_grad_(True)
    net.layers[2].bias.requires_grad_(False)
    model(torch.ones(2, 8)).sum().backward()
    assert isinstance(net.layers[1].weight.grad, rt.ShardGrad)
    assert net.layers[2].bias.grad is None
    opt.step()
    opt.zero_grad()
    last = model.full_state()
    assert not torch.equal(last["layers.1.weight"], after["layers.1.weight"])
    assert torch.equal(last["layers.2.bias"], after["layers.2.bias"])


def test_no_torch_function_is_replaced():
    """Importing ragshard.torch leaves torch's clipping functions torch's own."""
    import torch.nn.utils.clip_grad as clip_grad
    for name in ("clip_grad_norm_", "clip_grad_value_", "get_total_norm",
                 "clip_grads_with_norm_"):
        fn = getattr(torch.nn.utils, name)
        assert fn.__module__ == "torch.nn.utils.clip_grad", name
        assert fn.__code__.co_filename == clip_grad.__file__, name


def test_the_hints_are_accepted_and_the_post_optim_event_waited_for(shard):
    net, model = shard()

    class Event:
        waited = 0

        def synchronize(self):
            Event.waited += 1
    net.set_post_optim_event(Event())
    net.set_is_last_backward(False)
    net.set_force_sum_reduction_for_comms(True)
    net.set_allocate_memory_from_process_group_for_comm(True)
    rt.share_comm_ctx([net.layers[0], net.layers[1]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.ones(2, 8)).sum().backward()
    assert Event.waited == 1
