"""What every section of the job spec shares: the refusal type, the numeric bounds, and
``_Strict`` (unknown keys refused, no coercion, every number in range)."""

from __future__ import annotations

from pydantic import (
    BaseModel,
    ConfigDict,
    field_validator,
)

from services.contract.failures import Refusal


class JobSpecError(ValueError, Refusal):
    """A job spec that cannot be used; the message is one line naming file and field."""


# Ranges (checked at submit, so that no value fails later, half-way through a job's start).
# Every spec integer travels in a proto field or an int64 tensor (LoopState) somewhere:
# none may exceed int64; fields carried as uint32 / int32 say so with their own bound.
I64_MAX = 2**63 - 1
U32_MAX = 2**32 - 1
I32_MAX = 2**31 - 1
# A job's world size (dp x tp x pp): far beyond any cluster Surge is built for (issue 28's
# goal is 8,192 ranks), so an absurd size is refused in one line before control works on
# it (dp 10,000,000 passed the old bound, 2^32 - 1, and ran control out of time and memory).
MAX_WORLD_SIZE = 1 << 20
# A model's depth: 16x the deepest transformers trained (DeepNet, 1,000 layers). Surge names,
# checks (``model.freeze``: pattern by name) and builds a model layer by layer, so an absurd
# depth is refused in one line (2^31 - 1 layers ran `submit --dry-run` out of memory).
MAX_LAYERS = 1 << 14
# A team quota's slot count (control's quotas and surgectl team set alike): no cluster has this
# many slots; a bigger number is a typing mistake.
MAX_TEAM_SLOTS = 1_000_000
# Floats: finite (no .inf / .nan: ConfigDict allow_inf_nan) and at most this in magnitude.
FLOAT_MAX = 1e15
# Durations (``*_seconds``): a deadline longer than this is a mistake (30 days), and
# longer than ``threading.TIMEOUT_MAX`` cannot even be armed.
SECONDS_MAX = 30 * 24 * 3600.0
# Tokens per micro-batch (seq_len x micro_batch_size): the data service packs them as two
# int32 arrays (inputs, labels) into one MicroBatch message, which gRPC caps at 64 MiB.
MICRO_BATCH_TOKENS_MAX = 2**22
# The shortest heartbeat period a rank may ask for (seconds): each beat is a message through
# its node agent to control, from every rank.
MIN_BEAT_SECONDS = 0.01


class _Strict(BaseModel):
    # strict: "120" is not an integer; a spec says what it means or is refused.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _numbers_in_range(cls, value: object, info) -> object:
        """The floor under every numeric field of every section, new ones included: an
        integer (alone, in a list or a mapping) fits int64; a float is at most FLOAT_MAX
        in magnitude, a ``*_seconds`` one at most SECONDS_MAX. Tighter bounds are on the
        fields themselves."""
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        for v in items:
            if isinstance(v, bool):
                continue
            if isinstance(v, int) and not -I64_MAX - 1 <= v <= I64_MAX:
                raise ValueError(f"{v} does not fit a 64-bit integer (at most {I64_MAX})")
            if isinstance(v, float):
                top = SECONDS_MAX if (info.field_name or "").endswith("_seconds") else FLOAT_MAX
                if abs(v) > top:
                    what = f"{top:.0f} s (30 days)" if top == SECONDS_MAX else f"{top:g}"
                    raise ValueError(f"{v!r} is out of range (at most {what})")  # (repr: never rounded)
        return value
