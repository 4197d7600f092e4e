"""Certification: proof, on the booted model, that each served hook holds the tensor its
name promises.

A driver runs the checks (``equation_checks``: the block's own equations, recomputed from
the captured sites; ``compare`` against a reference; ``check_rounding`` for how far two
computations of one value may differ in a dtype) and reports a ``Certification``: each
hook's ``HookCertificate`` and the level the model is served at. Researchers read it as
``bridge.certification`` and ``tl certify``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tl_core._lazy import attach

if TYPE_CHECKING:
    from tl_core.certification._equations import (
        equation_checks as equation_checks,
        stacked_equation_checks as stacked_equation_checks,
    )
    from tl_core.certification._report import (
        CERTIFIED_STATUSES as CERTIFIED_STATUSES,
        Certification as Certification,
        CertificationCheck as CertificationCheck,
        CertifiedStatus as CertifiedStatus,
        HookCertificate as HookCertificate,
        certified_level as certified_level,
        compare as compare,
        compare_differs as compare_differs,
        silent_hook_checks as silent_hook_checks,
        statuses_from_checks as statuses_from_checks,
    )
    from tl_core.certification._rounding import (
        DEFAULT_ERROR_FACTOR as DEFAULT_ERROR_FACTOR,
        RoundingCheck as RoundingCheck,
        check_rounding as check_rounding,
    )

__getattr__, __dir__, __all__ = attach(__name__)
