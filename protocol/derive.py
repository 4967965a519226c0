"""Wire models built from the plain dataclasses that declare them once
(protocol/options.py, protocol/stats.py): the same fields, types and defaults,
each field's bounds as pydantic constraints and its doc as the description.

The declarations stay plain so that the executor uses them where pydantic is
not installed; this is the one place that turns them into validated models.
"""

from __future__ import annotations

import dataclasses
from typing import Any, get_type_hints

from pydantic import Field, create_model

from protocol.base import WireModel


def wire_model(declared: type[Any], *, base: type[WireModel] = WireModel, module: str,
               types: dict[str, Any] | None = None) -> type[WireModel]:
    """The wire model of the dataclass `declared`, subclassing `base`, defined in
    `module`. `types` replaces a field's type where the wire's differs (an id the
    executor keeps as an int travels as the client's string)."""
    hints = get_type_hints(declared) | (types or {})
    specs: dict[str, Any] = {}
    for spec in dataclasses.fields(declared):
        bounds = spec.metadata.get("bounds")
        constraints = {} if bounds is None else {"ge": bounds.ge, "gt": bounds.gt, "le": bounds.le}
        if spec.default is not dataclasses.MISSING:
            default: dict[str, Any] = {"default": spec.default}
        elif spec.default_factory is not dataclasses.MISSING:
            default = {"default_factory": spec.default_factory}
        else:
            default = {}
        specs[spec.name] = (hints[spec.name], Field(**default, **constraints, description=spec.metadata.get("doc")))
    return create_model(declared.__name__, __base__=base, __doc__=declared.__doc__, __module__=module, **specs)
