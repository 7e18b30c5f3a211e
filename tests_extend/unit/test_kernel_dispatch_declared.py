"""Kernel dispatch a reader can follow: KERNEL_NAMES is what KernelsAPI declares, DispatchKernels
writes one method per kernel with the API's signature and hands each call to that kernel's
implementation, and every kernel a catalogue names exists in the module that serves it."""
import ast
import importlib.util
import inspect
import pathlib
import types

import pytest

from mindspeed.backends.base import KERNEL_CAPS, KERNEL_NAMES, DispatchKernels, KernelsAPI
from mindspeed.backends.mindspore.capabilities import FAST_KERNELS
from mindspeed.backends.torch.kernels.catalog import FAST_PATHS

KERNELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "mindspeed" / "backends"


def test_kernel_names_are_the_kernels_the_api_declares_in_order():
    assert set(KERNEL_NAMES) == KernelsAPI.__abstractmethods__
    assert len(KERNEL_NAMES) == len(set(KERNEL_NAMES))
    declared = [name for name in vars(KernelsAPI) if name in KernelsAPI.__abstractmethods__]
    assert list(KERNEL_NAMES) == declared
    assert "dropout_add_layer_norm" in KERNEL_NAMES     # both backends implement it (reference.py)
    assert {k for kernels in KERNEL_CAPS.values() for k in kernels} <= set(KERNEL_NAMES)


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_dispatch_writes_each_kernel_as_a_method_with_the_api_signature(name):
    method = DispatchKernels.__dict__.get(name)     # in the class body, not inherited nor generated
    assert inspect.isfunction(method), f"DispatchKernels declares no method {name}"
    assert method.__qualname__ == f"DispatchKernels.{name}"
    assert inspect.signature(method) == inspect.signature(KernelsAPI.__dict__[name])
    assert not DispatchKernels.__abstractmethods__


def _recording_module(tag, calls):
    """A kernel module whose every kernel records (tag, name, args, kwargs) and returns that tuple."""
    def kernel(name):
        def record(*args, **kwargs):
            calls.append((tag, name, args, kwargs))
            return tag, name
        return record
    return types.SimpleNamespace(**{name: kernel(name) for name in KERNEL_NAMES})


def _call_and_expected_forward(name, *, every_argument=False):
    """Arguments for kernel `name` (a distinct object per parameter given) and the call its
    implementation must receive: positional parameters in order, keyword-only ones by name, the
    API's defaults for those not given. Without `every_argument` only the required ones are given."""
    params = list(inspect.signature(KernelsAPI.__dict__[name]).parameters.values())[1:]   # no self
    args, kwargs, fwd_args, fwd_kwargs = [], {}, [], {}
    for p in params:
        given = every_argument or p.default is inspect.Parameter.empty
        value = object() if given else p.default
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            if given:
                kwargs[p.name] = value
            fwd_kwargs[p.name] = value
        else:
            if given:
                args.append(value)
            fwd_args.append(value)
    return args, kwargs, (tuple(fwd_args), fwd_kwargs)


@pytest.mark.parametrize("every_argument", [False, True], ids=["defaults", "every-argument"])
@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_each_method_hands_its_call_to_its_own_kernel_fast_or_reference(name, every_argument):
    calls = []
    reference, fast = _recording_module("reference", calls), _recording_module("fast", calls)
    kernels = DispatchKernels(reference, fast, {name})
    args, kwargs, (fwd_args, fwd_kwargs) = _call_and_expected_forward(name, every_argument=every_argument)

    assert getattr(kernels, name)(*args, **kwargs) == ("fast", name)
    assert getattr(kernels.reference, name)(*args, **kwargs) == ("reference", name)
    assert calls == [("fast", name, fwd_args, fwd_kwargs), ("reference", name, fwd_args, fwd_kwargs)]
    others = [other for other in KERNEL_NAMES if other != name]
    assert all(kernels.implementation(other) is getattr(reference, other) for other in others)


def test_the_reference_dispatcher_is_the_same_class_with_no_fast_path():
    class Extended(DispatchKernels):
        pass
    calls = []
    reference, fast = _recording_module("reference", calls), _recording_module("fast", calls)
    kernels = Extended(reference, fast, {"rms_norm"})
    assert type(kernels.reference) is Extended and kernels.reference is not kernels
    assert kernels.reference.reference is kernels.reference
    assert all(kernels.reference.implementation(n) is getattr(reference, n) for n in KERNEL_NAMES)
    plain = Extended(reference)
    assert plain.reference is plain


def _top_level_functions(path):
    """Functions a kernel module defines, read from its source (npu.py imports torch_npu)."""
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("backend, catalogue, module_of", [
    ("torch", FAST_PATHS, {"cpu": "cpu.py", "cuda": "cuda.py", "npu": "npu.py"}),
    ("mindspore", FAST_KERNELS, {"ascend": "ascend.py"}),
])
def test_every_catalogued_fast_path_is_a_kernel_its_module_defines(backend, catalogue, module_of):
    kernels_dir = KERNELS_DIR / backend / "kernels"
    assert KERNEL_NAMES and set(KERNEL_NAMES) <= _top_level_functions(kernels_dir / "reference.py")
    for device, names in catalogue.items():
        assert set(names) <= set(KERNEL_NAMES), (backend, device)
        if names:
            missing = set(names) - _top_level_functions(kernels_dir / module_of[device])
            assert not missing, f"{backend}/{device}: {module_of[device]} lacks {sorted(missing)}"


def _importable_kernel_modules():
    """The kernel modules this machine can import: torch's but npu.py (torch_npu), and
    MindSpore's where MindSpore is installed."""
    from mindspeed.backends.torch.kernels import cpu, cuda, reference as torch_reference
    modules = [torch_reference, cpu, cuda]
    if importlib.util.find_spec("mindspore") is not None:
        from mindspeed.backends.mindspore.device_select import import_mindspore
        import_mindspore()     # its logs quieted first, as the backend does
        from mindspeed.backends.mindspore.kernels import ascend, reference as ms_reference
        modules += [ms_reference, ascend]
    return modules


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_each_kernel_implementation_takes_the_call_dispatch_makes_with_the_same_defaults(name):
    """DispatchKernels forwards the API's defaults explicitly: an implementation with another
    default would change behaviour behind the dispatcher."""
    _, _, (fwd_args, fwd_kwargs) = _call_and_expected_forward(name)
    api = inspect.signature(KernelsAPI.__dict__[name]).parameters
    implementations = [getattr(m, name) for m in _importable_kernel_modules() if hasattr(m, name)]
    assert implementations                    # torch's reference at least
    for impl in implementations:
        signature = inspect.signature(impl)
        signature.bind(*fwd_args, **fwd_kwargs)
        for p in signature.parameters.values():
            if p.name in api and p.default is not inspect.Parameter.empty:
                assert p.default == api[p.name].default, (impl.__module__, name, p.name)
