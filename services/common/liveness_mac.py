"""The mac of a node agent's liveness datagram (``AgentLiveness``), one rule for both ends:
the agent that signs (services/worker/liveness_sender.py) and control that checks
(services/control/liveness_datagrams.py).

HMAC-SHA256 with the session's ``LivenessGrant.key`` over the fields packed little-endian as
``<IQQdd`` (slot, session, seq, interval_seconds, unix_time) followed by the ``progress`` bytes
as sent (the ranks' beats riding, services/common/liveness_progress.py; opaque bytes in the
message, so both ends mac the same bytes), not over a serialization: two protobuf encoders need
not agree byte for byte, the packing does.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

_PACK = struct.Struct("<IQQdd")


def liveness_mac(key: bytes, msg: Any) -> bytes:
    """32 bytes: the mac of ``msg`` (an AgentLiveness; its ``mac`` field is not covered)."""
    packed = _PACK.pack(msg.slot, msg.session, msg.seq, msg.interval_seconds, msg.unix_time)
    return hmac.new(key, packed + msg.progress, hashlib.sha256).digest()
