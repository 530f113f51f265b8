"""``--output-format json``: a list of findings, schema in docs/json-schema.md (stable: fields are only added)."""

from __future__ import annotations

import json
from typing import Sequence

from gpudoctor.check.finding import Finding


def render(findings: Sequence[Finding], errors: Sequence[str]) -> str:
    return json.dumps(
        {
            "version": 1,
            "findings": [f.to_dict() for f in findings],
            "errors": list(errors),
        },
        indent=2,
    )
