"""vmmt.Pool.publish of real PyTorch CPU tensors (Debian's python3-torch) on
the emulated driver: what a tensor reads is what is published, whatever lazy
bit or autograd state it carries (test_attack_wire found a negative view
published without its sign). Skipped without torch."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")


def _back(consumer, desc, like):
    """The published bytes, read back into a tensor of `like`'s dtype and shape."""
    out = torch.empty(like.shape, dtype=like.dtype)
    consumer.consume(desc, out=out, ranks=0)
    return out


@pytest.mark.parametrize("make", [
    lambda: torch._neg_view(torch.tensor([1.0, -2.0, 3.0])),
    lambda: torch.tensor([1 + 2j, 3 - 1j]).conj(),
    lambda: torch.tensor([1 + 2j, 3 - 1j]).conj().imag,
    lambda: torch.arange(6.0).requires_grad_(),
    lambda: torch.nn.Parameter(torch.arange(4.0)),
    lambda: torch.arange(6.0).requires_grad_().reshape(2, 3).t(),
    lambda: torch.tensor([[True, False], [False, True]]),
], ids=["neg-view", "conj", "conj-imag", "requires-grad", "parameter", "grad-transposed", "bool"])
def test_published_bytes_are_the_values_read(pool, consumer, make):
    src = make()
    want = src.detach().resolve_conj().resolve_neg().contiguous()
    got = _back(consumer, pool.publish(src), want)
    assert torch.equal(got, want), (got, want)


def test_packed_members_with_lazy_bits(pool, consumer):
    a = torch._neg_view(torch.arange(4.0))
    b = torch.tensor([1j, 2 + 1j]).conj()
    descs = pool.publish_many([a, b])
    for d, src in zip(descs, (a, b)):
        want = src.resolve_conj().resolve_neg()
        assert torch.equal(_back(consumer, d, want), want)
    assert np.array_equal(a.resolve_neg().numpy(), [-0.0, -1.0, -2.0, -3.0])
