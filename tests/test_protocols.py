"""Every gradient engine, runner and transport implements its Protocol
(``parallel/engine.py``, ``parallel/runner.py``, ``comm/transport.py``) with the same
signatures, and sets every attribute the Protocol declares: a caller written against the
interface works with any of them."""

import ast
import inspect
import textwrap

import pytest
from mpi4py import MPI

from hpctrain.comm.buffers import MPIBuffer
from hpctrain.comm.xccl_transport import XcclBuffer, XcclTransport
from hpctrain.comm.shm_transport import ShmTransport
from hpctrain.comm.transport import CommBuffer, MPITransport, PersistentMPITransport, Transport
from hpctrain.config import OptimConfig, load_config
from hpctrain.model.gpt import GPT, GPTConfig
from hpctrain.parallel.choose_engine import build_engine, engine_class
from hpctrain.parallel.data_parallel import DataParallel
from hpctrain.parallel.engine import GradEngine
from hpctrain.parallel.mixed_precision import MixedPrecisionDataParallel
from hpctrain.parallel.pipeline.executor import PipelineExecutor
from hpctrain.parallel.runner import LocalRunner, Runner, RunnerStats
from hpctrain.parallel.zero import Zero
from tests.helpers import cpu_world

ENGINES = [DataParallel, MixedPrecisionDataParallel, Zero]
RUNNERS = [LocalRunner, PipelineExecutor]
TRANSPORTS = [MPITransport, PersistentMPITransport, ShmTransport, XcclTransport]
BUFFERS = [MPIBuffer, XcclBuffer]


def _members(protocol) -> dict:
    """The Protocol's methods and properties by name (its own, not object's)."""
    return {n: v for n, v in vars(protocol).items()
            if not n.startswith("_") and (callable(v) or isinstance(v, property))}


def _attributes(protocol) -> list[str]:
    """The data attributes the Protocol declares (annotated, not methods)."""
    return [n for n in vars(protocol).get("__annotations__", {}) if not n.startswith("_")]


def _sets(impl, name: str) -> bool:
    """Whether ``impl`` (or a class it inherits from) has ``name`` as a class attribute or
    annotation, or assigns ``self.<name>`` in one of its methods."""
    for cls in impl.__mro__[:-1]:  # not object
        if name in vars(cls) or name in vars(cls).get("__annotations__", {}):
            return True
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and t.attr == name and \
                            isinstance(t.value, ast.Name) and t.value.id == "self":
                        return True
    return False


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("protocol,impl", [(GradEngine, e) for e in ENGINES]
                         + [(Runner, r) for r in RUNNERS]
                         + [(Transport, t) for t in TRANSPORTS]
                         + [(CommBuffer, b) for b in BUFFERS])
def test_each_implementation_has_every_member_with_the_protocols_signature(protocol, impl):
    members = _members(protocol)
    assert members, "the Protocol declares nothing"
    for name, declared in members.items():
        assert hasattr(impl, name), f"{impl.__name__} lacks {name}"
        actual = getattr(impl, name)
        if isinstance(declared, property):
            assert isinstance(actual, property), f"{impl.__name__}.{name} is not a property"
            continue
        assert _parameters(actual) == _parameters(declared), \
            f"{impl.__name__}.{name}{inspect.signature(actual)} differs from the Protocol's " \
            f"{inspect.signature(declared)}"


@pytest.mark.parametrize("protocol,impl", [(GradEngine, e) for e in ENGINES]
                         + [(Runner, r) for r in RUNNERS])
def test_each_implementation_sets_every_attribute_the_protocol_declares(protocol, impl):
    declared = _attributes(protocol)
    assert declared, "the Protocol declares no attribute"
    missing = [n for n in declared if not _sets(impl, n)]
    assert not missing, f"{impl.__name__} never sets {missing}"


def _tiny():
    return GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=2, n_head=2, n_embd=16))


@pytest.mark.parametrize("build", [
    lambda m, w: DataParallel(m, w, OptimConfig()),
    lambda m, w: MixedPrecisionDataParallel(m, w, OptimConfig()),
    lambda m, w: Zero(m, w, OptimConfig(), level=3, blocks=list(m.h)),
], ids=["dp", "bf16-dp", "zero3"])
def test_built_engines_are_grad_engines_and_step_returns_a_float(build):
    model = _tiny()
    engine = build(model, cpu_world(MPI.COMM_SELF))
    assert isinstance(engine, GradEngine)  # attributes too (model, stats)
    engine.prepare_for_backward(True)
    import torch
    x = torch.randint(0, 16, (2, 8))
    model(x, x).backward()
    engine.finish()
    norm = engine.step(1e-3, 1.0)
    assert type(norm) is float and norm > 0
    engine.close()


def test_local_runner_is_a_runner():
    runner = LocalRunner(_tiny())
    assert isinstance(runner, Runner) and isinstance(runner.stats, RunnerStats)
    assert runner.order_times is None  # a whole model: no pass order built for any times


@pytest.mark.parametrize("zero,dtype,expected", [
    (0, "fp32", DataParallel), (0, "bf16", MixedPrecisionDataParallel),
    (1, "fp32", Zero), (2, "bf16", Zero), (3, "fp32", Zero)])
def test_one_rule_chooses_the_engine_that_parallelize_builds_and_reshard_writes_for(
        zero, dtype, expected):
    assert engine_class(zero, dtype) is expected
    cfg = load_config("default", [f"--parallel.zero={zero}", f"--train.dtype={dtype}"])
    model = _tiny()
    engine = build_engine(model, cpu_world(MPI.COMM_SELF), cfg, blocks=list(model.h))
    assert type(engine) is expected
    # ckpt reshard writes the state kind of the engine that will resume the checkpoint
    assert engine.state_shards().kind == expected.state_kind
    assert (expected.state_kind == "replicated") == (zero == 0 and dtype == "fp32")
    engine.close()


@pytest.mark.parametrize("make", [
    lambda w: MPITransport(w.comm, w.accel, w.gpu_aware),
    lambda w: PersistentMPITransport(w.comm, w.accel, w.gpu_aware),
    lambda w: ShmTransport(w.comm, w.accel, w.gpu_aware, [5]),
], ids=["iallreduce", "persistent", "shm"])
def test_built_transports_are_transports_and_sum_a_gradient_bucket(make):
    import torch
    transport = make(cpu_world(MPI.COMM_SELF))
    assert isinstance(transport, Transport)
    flat = transport.flat(0) if isinstance(transport, ShmTransport) else torch.zeros(5)
    flat.copy_(torch.arange(5.0))
    buf = transport.buffer(flat, reduction=True)
    assert isinstance(buf, CommBuffer)
    buf.prepare()
    assert buf.prepared and buf.ready()
    req = transport.allreduce(buf)
    while not req.Test():
        pass
    buf.complete()
    torch.testing.assert_close(flat, torch.arange(5.0))  # one rank: the sum is itself
    transport.close()
    transport.close()  # idempotent
