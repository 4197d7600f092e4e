"""Write docs/intervention-spec.schema.json from ``tl_core``'s ``SPEC_JSON_SCHEMA``.

Usage: ``python scripts/write_spec_schema.py`` (rewrite) or ``... --check`` (exit 1 if the
file is stale). A test in tl-core fails when the file does not match.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_PATH = ROOT / "docs" / "intervention-spec.schema.json"


def render() -> str:
    """The schema file's exact text."""
    try:
        from tl_core.specs._specs import SPEC_JSON_SCHEMA
    except ImportError:
        sys.path.insert(0, str(ROOT / "packages" / "tl-core" / "src"))
        from tl_core.specs._specs import SPEC_JSON_SCHEMA
    return json.dumps(SPEC_JSON_SCHEMA, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` verify) the schema file; return the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = SCHEMA_PATH.read_text(encoding="utf-8") if SCHEMA_PATH.exists() else None
        if current != text:
            print(f"{SCHEMA_PATH} is stale; run python scripts/write_spec_schema.py")
            return 1
        return 0
    SCHEMA_PATH.parent.mkdir(parents=True, exist_ok=True)
    SCHEMA_PATH.write_text(text, encoding="utf-8")
    print(f"wrote {SCHEMA_PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
