"""A weighted mixture's stream: the blended global sequence of several datasets, dealt to dp ranks.

The blended sequence (``blend.py``, Megatron-LM's BlendedDataset rule) says which component
each blended row comes from and which row of that component's own global sequence it is.
Each component is an ordinary stream (its own pipeline L4-1..L4-5 on its own bus, built by
the composition root, with its own sample index, epochs and position), opened at world
size 1 and micro-batch size 1 so that its "batches" are its own sequence's rows one by one.

Where the blend sits, and why here: the seed gives ordering to the shuffler (L4-3) and
forbids the packer (L4-5) to reorder; but a shuffler orders the documents of the one dataset
version its pipeline mounted, and a mixture is an order *between* pipelines. So the blend is
a pure ordering rule (``blend.py``) applied above the component pipelines by the stream's
relay (L2-1's stand-in, carrying out the weights the loop wrote into ``OpenStream.mixture``),
and every module of every component keeps its role unchanged: a component's shuffler orders
its documents and rows, its packer cuts and deals them (here: to one "rank", the mixture).

The deal is the packer's (``batch_packer.py``): from the stream's start, blended rows are
cut into slots of ``micro_batch_size`` and slot m goes to dp rank ``m % world_size``. This
rank reads the tokens of its own slot's rows only: the rows of a component the blend gives
other ranks are passed over (``AssembleBatches.skip``, no token read), and at each round's
end every component is brought to the round's end, so its own (epoch, row) is known there.

Position: ``DataPosition(epoch=0, row=blended row, format="mix-v1")``; each component's
position at that row (rows taken, its own (epoch, row)) rides in ``MicroBatch.components``.
A resume opens every component at its start and passes over ``count_k(row)`` of its rows:
exact at any dp size, the global batch's rows being the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.contract import data_pb2
from services.data import blend, sample_index
from services.data.errors import InvalidConfig

if TYPE_CHECKING:
    from services.data.server import StreamRelay


def format_refused(where: str, got: str, want: str) -> str:
    """The one line refusing a position of a plain stream for a mixture, or the other way."""
    kind = {blend.FORMAT: "a mixture's", **{f: "a single dataset's" for f in sample_index.COMPATIBLE}}
    return (
        f"{where}: position in format {got!r} ({kind.get(got, 'unknown')}), this stream takes format "
        f"{want!r} ({kind[want]}): a checkpoint of a mixture resumes only a mixture, and the other way"
    )


class MixtureStream:
    """One rank's stream of a mixture (see the module docstring): :meth:`open`, then
    :meth:`next_batches` until it returns nothing, then :meth:`close`."""

    def __init__(self, req: data_pb2.OpenStream, new_component: Callable[[], StreamRelay]):
        self._req = req
        self._new_component = new_component
        self._components: list[StreamRelay] = []
        self._taken: list[int] = []  # rows of each component's sequence passed over or read
        self._names = [f"{c.mount.name}@{c.mount.version}" for c in req.mixture]
        self._blend: blend.Blend | None = None
        self._start = 0
        self._rounds = 0
        self.batches_sent = 0
        self.tokens_sent = 0
        self.positions: list[data_pb2.ComponentPosition] = []

    def open(self) -> None:
        """Open every component and bring it to the start's blended row.

        Raises:
            InvalidConfig: a mount besides the mixture, a weight <= 0, a start of another
                format or epoch, a single pass without ``max_batches``.
            DataError subclasses: a component cannot open (see server.STATUS).
        """
        req = self._req
        if req.mount.name:
            raise InvalidConfig(f"open_stream: mount {req.mount.name!r} and mixture both given: one or the other")
        try:
            self._blend = blend.Blend([c.weight for c in req.mixture])
        except ValueError as e:
            raise InvalidConfig(f"open_stream.mixture: {e}") from None
        start = req.start
        if req.HasField("start") and start.format != blend.FORMAT:
            raise InvalidConfig(format_refused("open_stream.start", start.format, blend.FORMAT))
        if start.epoch or start.document or start.offset:
            raise InvalidConfig(
                f"open_stream.start: a mixture's position is epoch 0 and a row, got epoch {start.epoch}"
            )
        if not req.repeat and not req.max_batches:
            raise InvalidConfig("open_stream: a mixture's single pass has no end: set max_batches")
        self._start = int(start.row)
        counts = self._blend.counts(self._start)
        for c, n in zip(req.mixture, counts, strict=True):
            relay = self._new_component()
            self._components.append(relay)
            relay.open(self._component_request(c))
            relay.next_batches(0, skip=n)  # the rows before the start: no token read
            self._taken.append(n)
        self.positions = self._positions(counts)

    def _component_request(self, c: data_pb2.MixtureComponent) -> data_pb2.OpenStream:
        req = self._req
        out = data_pb2.OpenStream(mount=c.mount, split=req.split, repeat=True)
        out.prefetch.CopyFrom(req.prefetch)
        out.shuffle.CopyFrom(req.shuffle)
        out.shuffle.epoch = 0
        out.filter.CopyFrom(req.filter)
        out.packer.CopyFrom(req.packer)
        out.packer.ClearField("start")
        out.packer.rank, out.packer.world_size, out.packer.micro_batch_size = 0, 1, 1  # its rows one by one
        return out

    def next_batches(self, count: int) -> list[data_pb2.MicroBatch]:
        """Up to ``count`` more micro-batches of this rank (none after ``max_batches``)."""
        req = self._req
        if req.max_batches:
            count = min(count, req.max_batches - self.batches_sent)
        out = [self._round() for _ in range(max(count, 0))]
        self.batches_sent += len(out)
        self.tokens_sent += sum(b.tokens for b in out)
        return out

    def _round(self) -> data_pb2.MicroBatch:
        p = self._req.packer
        B, W = p.micro_batch_size, max(p.world_size, 1)
        first = self._start + self._rounds * W * B + p.rank * B
        self._rounds += 1
        end = self._start + self._rounds * W * B
        rows: list[data_pb2.MicroBatch] = []
        for k, j in self._blend.sources(first, B):
            got = self._components[k].next_batches(1, skip=j - self._taken[k])
            self._taken[k] = j + 1
            rows.append(got[0])
        counts = self._blend.counts(end)
        for k, n in enumerate(counts):  # every component to the round's end: its own position
            if n > self._taken[k]:
                self._components[k].next_batches(0, skip=n - self._taken[k])
                self._taken[k] = n
        self.positions = self._positions(counts)
        report = data_pb2.FilterReport()
        for c in self._components:
            for field in ("kept", "dropped_too_short", "dropped_too_long", "dropped_banned"):
                setattr(report, field, getattr(report, field) + getattr(c.report, field))
        return data_pb2.MicroBatch(
            input_ids=b"".join(r.input_ids for r in rows),
            labels=b"".join(r.labels for r in rows),
            batch_size=B,
            seq_len=p.seq_len,
            tokens=sum(r.tokens for r in rows),
            next=data_pb2.DataPosition(epoch=0, row=end, format=blend.FORMAT),
            filter=report,
            components=self.positions,
        )

    def _positions(self, counts: list[int]) -> list[data_pb2.ComponentPosition]:
        return [
            data_pb2.ComponentPosition(dataset=name, rows=n, position=c.position)
            for name, n, c in zip(self._names, counts, self._components, strict=True)
        ]

    def close(self) -> None:
        for c in self._components:
            c.close()
