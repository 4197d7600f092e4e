"""The template of a tl driver: copy this package to add an engine (see its README).

This module is what the ``tl_core.drivers`` entry point names, so it stays cheap: the
driver and its engine load only when the driver is booted.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tl_core.driver_api import DriverEntry
from tl_driver_template._version import __version__

if TYPE_CHECKING:
    from tl_driver_template._driver import TemplateDriver as TemplateDriver

__all__ = ["ENTRY", "TemplateDriver", "__version__"]

#: The driver's entry, named by this distribution's ``tl_core.drivers`` entry point.
ENTRY = DriverEntry(
    name="template",
    distribution="tl-driver-template",
    loader="tl_driver_template._driver:TemplateDriver",
    # A real driver requires its engine in pyproject.toml with the tested version window
    # ("my-engine>=1.4,<1.5") and names it here, read from that metadata:
    # EngineRequirement.declared_by("tl-driver-NAME", ("my-engine",)); it is checked before loading.
    engine=None,
    features=frozenset({"generation", "batching", "position_interventions"}),
    kind="remote",
    description="template driver over a stand-in engine (copy it to add an engine)",
)


def __getattr__(name: str) -> Any:
    if name != "TemplateDriver":
        raise AttributeError(f"module 'tl_driver_template' has no attribute {name!r}")
    return importlib.import_module("tl_driver_template._driver").TemplateDriver
