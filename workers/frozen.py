"""Frozen dataclasses built once per request per step, built faster.

A frozen dataclass's generated `__init__` sets each field through `object.__setattr__` (its own
`__setattr__` refuses), one call per field: for the records the step loop makes for every
request of every step (a step's `StepResult`, a `WorkItem`, an α estimate), that was a
measurable part of a step. `fills_dict` gives such a class an `__init__` with the same
signature that fills the instance's `__dict__` in one call; the instance is as frozen, equal,
hashable, picklable and `replace`-able as before. For classes with a `__dict__` (not
`slots=True`) and plain defaults (no `default_factory`).
"""
from __future__ import annotations

import dataclasses
from typing import TypeVar

T = TypeVar("T")


def fills_dict(cls: type[T]) -> type[T]:
    """Replace the frozen dataclass `cls`'s `__init__` (module docstring); returns `cls`."""
    params = dataclasses.fields(cls)
    if not cls.__dataclass_params__.frozen or "__slots__" in cls.__dict__:
        raise TypeError(f"{cls.__name__}: fills_dict is for frozen dataclasses with a __dict__")
    defaults, args = {}, []
    for f in params:
        if f.default_factory is not dataclasses.MISSING or not f.init or f.kw_only:
            raise TypeError(f"{cls.__name__}.{f.name}: only plain positional fields")
        if f.default is dataclasses.MISSING:
            args.append(f.name)
        else:
            defaults[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
    names = ", ".join(f"{f.name}={f.name}" for f in params)
    post = "\n    self.__post_init__()" if hasattr(cls, "__post_init__") else ""
    source = f"def __init__(self, {', '.join(args)}):\n    self.__dict__.update({names}){post}\n"
    namespace: dict = {}
    exec(source, defaults, namespace)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init
    return cls
