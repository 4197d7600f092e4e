"""``tl drivers``: what is installed, in which versions, and why a broken driver fails."""

from __future__ import annotations

import argparse
import json
from typing import Any

from tl_core.driver_api._discovery import available_drivers

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``drivers`` subcommand."""
    parser = sub.add_parser(
        "drivers", help="list installed drivers, versions, engines and features"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(run=run)


def rows() -> list[dict[str, Any]]:
    """One dict per installed driver (broken ones included with their error)."""
    out = []
    for name, row in sorted(available_drivers().items()):
        entry = row.entry
        out.append(
            {
                "name": name,
                "distribution": row.distribution,
                "version": row.version,
                "engine": row.engine,
                "kind": entry.kind if entry else "-",
                "features": sorted(entry.features) if entry else [],
                "status": "ok" if row.error is None else "broken",
                "error": row.error,
            }
        )
    return out


def run(args: argparse.Namespace) -> int:
    """Print the listing."""
    table = rows()
    if args.json:
        print(json.dumps(table, indent=2))
        return 0
    if not table:
        print("no tl drivers installed (pip install tl-core provides 'native')")
        return 0
    header = ("driver", "distribution", "version", "engine", "kind", "status")
    lines = [header] + [
        (r["name"], r["distribution"], r["version"], r["engine"], r["kind"], r["status"])
        for r in table
    ]
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header))]
    for line in lines:
        print("  ".join(str(cell).ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
    for r in table:
        if r["error"]:
            print(f"\n{r['name']}: {r['error']}")
        elif r["features"]:
            print(f"\n{r['name']} features: {', '.join(r['features'])}", end="")
    print()
    return 0
