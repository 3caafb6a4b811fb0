"""The example frames of docs/protocol.md section 8, read from the page
itself, for the tests that check them (tests/unit/test_protocol.py against
the codec, tests/host/test_c_client.py against a real kvtierd)."""

from __future__ import annotations

import re
from pathlib import Path

PROTOCOL_MD = Path(__file__).resolve().parent.parent / "docs" / "protocol.md"


def doc_examples() -> list[bytes]:
    """Every hex dump in section 8, as bytes (frames: header and payload), in order."""
    text = PROTOCOL_MD.read_text()
    section = text[text.index("## 8. Examples"):text.index("## 9.")]
    out = []
    for block in re.findall(r"```\n(.*?)```", section, flags=re.S):
        data = b""
        for line in block.splitlines():
            m = re.match(r"^[0-9a-f]{4}  ((?:[0-9a-f]{2} ?)+)", line)
            assert m, f"not a hex dump line: {line!r}"
            data += bytes.fromhex(m.group(1).replace(" ", ""))
        out.append(data)
    return out
