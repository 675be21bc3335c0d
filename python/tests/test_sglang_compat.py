"""vmmt/_sglang_compat.py: "no room" in each shape the binding gives it
(PoolFull, a plain Error with status EFULL or ETOOBIG, the new NoRoom family,
publish_many's None), anything else raised; ranks spelled for both bindings."""
import pytest

import vmmt
from vmmt import _sglang_compat as compat


def error(cls, status):
    e = cls("refused")
    e.status = status
    return e


class FakePool:
    def __init__(self, outcome):
        self.outcome = outcome

    def _give(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def publish(self, array, stream=None):
        return self._give()

    def publish_many(self, arrays, stream=None):
        return self._give()


@pytest.mark.parametrize("exc", [error(vmmt.PoolFull, -7), error(vmmt.Error, -7),
                                 error(vmmt.Error, -15), error(compat.NoRoom, -15)])
def test_no_room_in_any_shape_is_none(exc):
    for arrays in (["a"], ["a", "b"]):
        assert compat.publish(FakePool(exc), arrays, None) is None


def test_publish_many_none_is_none_and_results_pass_through():
    assert compat.publish(FakePool(None), ["a", "b"], None) is None
    assert compat.publish(FakePool("desc"), ["a"], None) == ["desc"]
    assert compat.publish(FakePool(["d1", "d2"]), ["a", "b"], None) == ["d1", "d2"]


@pytest.mark.parametrize("exc", [error(vmmt.Error, -5), error(vmmt.Timeout, -8),
                                 ValueError("bad tensor")])
def test_other_failures_are_raised(exc):
    with pytest.raises(type(exc)):
        compat.publish(FakePool(exc), ["a"], None)


def test_quarantine_and_ranks():
    assert compat.is_quarantined(error(vmmt.Error, -9))
    assert not compat.is_quarantined(error(vmmt.Error, -7))
    assert list(compat.ranks(2, 3)) == [2, 3, 4]
