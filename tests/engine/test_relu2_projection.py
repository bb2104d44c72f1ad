"""The relu² MLP hands its up projection's output to the down projection's ``forward_relu2``
(``layers.project_relu2``): for the plain ``models.linear.Linear`` that is ``linear(x, w, b,
relu2=True)``, whose decode kernels apply relu² as they load x (CUDA; the kernels' bit-for-bit
checks are ``linear_cases.check_linear_relu2``, under the interpreter and on CUDA). On CPU it is
F.linear of relu2(x), exactly what the MLP computed before."""
import torch

from hybrid_engine.models.activation import relu2_ref
from hybrid_engine.models.layers import MLP
from hybrid_engine.models.linear import Linear, linear


@torch.no_grad()
def test_mlp_down_proj_takes_the_activation():
    g = torch.Generator().manual_seed(3)
    mlp = MLP(24, 40)
    for p in mlp.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    assert isinstance(mlp.down_proj, Linear)
    calls = []
    fused = mlp.down_proj.forward_relu2
    mlp.down_proj.forward_relu2 = lambda h: calls.append(tuple(h.shape)) or fused(h)
    x = torch.randn(5, 24, generator=g)
    y = mlp(x)
    assert calls == [(5, 40)]
    h = mlp.up_proj(x)
    assert torch.equal(y, torch.nn.functional.linear(relu2_ref(h), mlp.down_proj.weight))
    assert not torch.equal(y, mlp.down_proj(h))                       # the activation was applied
    seen = []                                  # with a forward hook the module is called on relu2(h)
    mlp.down_proj.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    assert torch.equal(mlp(x), y) and len(calls) == 1 and torch.equal(seen[0], relu2_ref(h))


def test_linear_relu2_off_the_fast_path_is_f_linear_of_relu2():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 16, generator=g) * 3
    w, b = torch.randn(8, 16, generator=g), torch.randn(8, generator=g)
    assert torch.equal(linear(x, w, b, relu2=True), torch.nn.functional.linear(relu2_ref(x), w, b))
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))


@torch.no_grad()
def test_a_global_forward_hook_sees_the_activation():
    """A hook registered for every module (``register_module_forward_hook``) also takes the
    unfused path, so it sees relu2(h) as the down projection's input."""
    g = torch.Generator().manual_seed(5)
    mlp = MLP(8, 16)
    for p in mlp.parameters():
        p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, 8, generator=g)
    seen = {}

    def record(mod, args, out):            # returns None: the module's output is kept
        seen.setdefault(id(mod), args[0])
    handle = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        y = mlp(x)
    finally:
        handle.remove()
    h = mlp.up_proj(x)
    assert torch.equal(seen[id(mlp.down_proj)], relu2_ref(h))
    assert torch.equal(y, mlp(x))
