"""What the ``hf`` driver serves after its boot-time certification.

A described family serves the hooks its equations certify; an inferred architecture is
certified in stages, each serving less, and refused when even its residual stream fails.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tl_core import ConfigError
from tl_core.driver_api import Certification
from tl_driver_hf._certify import boot_refusal, on_residual_stream

if TYPE_CHECKING:
    from tl_driver_hf._driver import HFDriver

__all__ = ["certify_at_boot"]

_LOG = logging.getLogger("tl_driver_hf")


def _first_certifiable(driver: HFDriver) -> Certification:
    """Certify an inferred model in stages, each serving less, until its run holds.

    First with every candidate hook and tl's hooked attention; then with the model's own
    attention (tl's may not reproduce a family's: sinks, extra inputs); then with the
    residual stream alone (a block whose insides do not run with tl's hooks).

    Raises:
        ConfigError: Not even the residual stream runs (names the error).
    """
    error: Exception | None = None
    cert: Certification | None = None
    for hooked, residual_only in ((True, False), (False, False), (False, True)):
        driver._hooked_attention = hooked
        if residual_only:
            names = list(driver._model.hook_points)
            kept = [n for n in names if on_residual_stream(n)]
            why = (
                f"{type(error).__name__}: {error}"
                if error is not None
                else "its block equations failed"
            )
            for n in names:
                if n not in kept:
                    driver._absent[n] = (
                        f"uncertified: tl's hooks inside this inferred block do not run ({why})"
                    )
            driver._build(kept)
        try:
            cert = driver.certify()
        except Exception as exc:  # the family's code does not run with these hooks
            error = exc
            continue
        if cert.residual_holds:
            return cert
    if cert is not None:
        return cert  # refused by the caller, with the failing equations
    raise ConfigError(
        f"architecture {driver._info.architecture!r} has no hand-written description and tl "
        f"cannot run the one inferred from its modules ({type(error).__name__}: {error}); "
        f"describe it with an ArchitectureAdapter (docs/adding-a-family.md)."
    )


def certify_at_boot(driver: HFDriver) -> None:
    """Certify, then serve only what passed; refuse an inferred model whose run is wrong."""
    name = driver._name
    inferred = driver._inferred is not None
    cert = _first_certifiable(driver) if inferred else driver.certify(thorough=False)
    refused = boot_refusal(
        cert, inferred=inferred, architecture=driver._info.architecture, family=driver._adapter.family,
        layers=driver._adapter.layers, name=name,
    )  # fmt: skip
    if refused is not None:
        raise refused
    dropped = [
        n
        for n in driver._model.hook_points
        if cert.statuses.get(n) is None or cert.statuses[n].status != "real"
    ]
    if dropped:
        for n in dropped:
            cert_n = cert.statuses.get(n)
            driver._absent[n] = f"uncertified: {cert_n.reason if cert_n else 'not checked'}"
        driver._build([n for n in driver._model.hook_points if n not in dropped])
        if not inferred:
            _LOG.warning(
                "%d hooks of %s failed certification and are not served (first: %s); see "
                "bridge.certification", len(dropped), name, dropped[0],
            )  # fmt: skip
    driver._certification = cert
    wrong_readout = [
        c
        for c in cert.failed
        if c.hooks and set(c.hooks) <= {"unembed.hook_out", "ln_final.hook_out"}
    ]
    if wrong_readout:
        driver._readout_refused = f"failed: {wrong_readout[0].equation}"
    driver._model.refused_weights.update(
        {name: w.reason for name, w in cert.weights.items() if w.status != "real"}
    )
    if inferred:
        _LOG.warning(
            "%s: architecture %s inferred from its modules (no hand-written description); "
            "%d hooks certified and served at level %r (tl certify %s shows the report)",
            name, driver._info.architecture, len(cert.served), cert.level, name,
        )  # fmt: skip
