"""``proxy.core.frozen.quick_init``: the same construction as the dataclass's own
``__init__``, the same frozen, equal and hashed values (#28)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.core.frozen import quick_init
from proxy.core.prepared import Prepared
from proxy.operators.entry import RequestEntry


@dataclass(frozen=True)
class Plain:
    a: int
    d: str  # (a name the made __init__ must not clobber)
    b: str = "bee"
    c: list[int] = field(default_factory=list)


@quick_init
@dataclass(frozen=True)
class Quick:
    a: int
    d: str
    b: str = "bee"
    c: list[int] = field(default_factory=list)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((1, "x"), {}), ((1, "x", "b2"), {}), ((), {"a": 1, "d": "x", "c": [3]}), ((1,), {"d": "y"})],
)
def test_the_same_values_as_the_dataclass_own_init(args: Any, kwargs: Any) -> None:
    plain, quick = Plain(*args, **kwargs), Quick(*args, **kwargs)
    assert dataclasses.asdict(plain) == dataclasses.asdict(quick)
    assert vars(plain) == vars(quick)


def test_frozen_equal_hashed_and_replaced_as_before() -> None:
    q = Quick(1, "x", "b", [])
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.a = 2  # type: ignore[misc]
    assert q == Quick(1, "x", "b", [])
    assert q != Quick(2, "x", "b", [])
    h = Quick(1, "x", "b", ())  # type: ignore[arg-type]
    assert hash(h) == hash(Quick(1, "x", "b", ()))  # type: ignore[arg-type]
    assert dataclasses.replace(q, a=5) == Quick(5, "x", "b", [])


def test_each_instance_gets_its_own_default_from_the_factory() -> None:
    one, two = Quick(1, "x"), Quick(1, "x")
    assert one.c == [] and one.c is not two.c


def test_wrong_calls_fail_as_the_dataclass_own_init_does() -> None:
    for cls in (Plain, Quick):
        with pytest.raises(TypeError):
            cls(1)  # type: ignore[call-arg]
        with pytest.raises(TypeError):
            cls(1, "x", nope=2)  # type: ignore[call-arg]
        with pytest.raises(TypeError):
            cls(1, "x", "b", [], "extra")  # type: ignore[call-arg]


def test_what_it_does_not_handle_is_refused() -> None:
    @dataclass
    class Thawed:
        a: int

    @dataclass(frozen=True)
    class After:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class Slotted:
        a: int

    @dataclass(frozen=True)
    class Hidden:
        a: int = field(default=0, init=False)

    @dataclass(frozen=True, kw_only=True)
    class Named:
        a: int

    for cls in (Thawed, After, Slotted, Hidden, Named):
        with pytest.raises(TypeError):
            quick_init(cls)


@pytest.mark.parametrize("cls", [Prepared, RequestEntry])
def test_the_request_path_values_are_built_by_it(cls: type) -> None:
    assert cls.__init__.__qualname__ == f"{cls.__qualname__}.__init__"
    assert "_qi_d" in cls.__init__.__code__.co_varnames
