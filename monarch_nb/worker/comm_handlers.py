"""The worker's handlers of collectives and borrows (a part of Worker, which
dispatches each message to the handler of its name)."""

from __future__ import annotations

import logging

from ..protocol import messages as m
from ..protocol.constants import DEFAULT_STREAM
from .borrow import Borrow
from .failure import describe
from .ref_cell import Cell, raw

logger = logging.getLogger("monarch_nb.worker")


class CommHandlers:
    """Handlers of InitBackend, CreateProcessGroup, Reduce, SendTensor and the borrows."""

    def InitBackend(self, msg: m.InitBackend) -> None:
        comms = self.comms
        stream, rank = self.streams[DEFAULT_STREAM], self.rank

        def init() -> None:
            try:
                comms.init_backend(msg.store, msg.backend, self)
                failure = None
            except BaseException as e:  # noqa: B036 - the controller fails the start with it
                logger.exception("torch.distributed failed to start")
                failure = describe(e)
            stream.outbox.send(m.FetchResult(msg.ident, rank, None, failure))

        stream.call_soon(init)

    def CreateProcessGroup(self, msg: m.CreateProcessGroup) -> None:
        self.comms.create_groups(msg.key, msg.groups)

    def Reduce(self, msg: m.Reduce) -> None:
        from . import reductions  # torch.distributed: loaded with the first collective

        src, out = self._cell(msg.source), self._cell(msg.out)
        result = self.env[msg.result] = Cell()
        comms = self.comms

        def work():
            return reductions.run_reduce(msg, comms, raw(src), None if out is None else raw(out))

        self._stream(msg.stream).schedule(msg.ident, msg.what, work, (result,))

    def SendTensor(self, msg: m.SendTensor) -> None:
        from . import collectives

        rank = self.rank
        send_to = next((t for f, t in msg.pairs if f == rank), None)
        recv_from = next((f for f, t in msg.pairs if t == rank), None)
        src = self._cell(msg.source) if send_to is not None else None
        results = ()
        if recv_from is not None:
            results = (Cell(),)
            self.env[msg.result] = results[0]
        comms = self.comms

        def work():
            pg, _ = comms.group(msg.key)
            value = None if src is None else raw(src)
            return collectives.send_recv(value, pg, rank, send_to, recv_from, comms.backend)

        self._stream(msg.stream).schedule(msg.ident, "to_mesh", work, results)

    def BorrowCreate(self, msg: m.BorrowCreate) -> None:
        lender, borrower = self._stream(msg.from_stream), self._stream(msg.to_stream)
        borrow = Borrow(lender, borrower)
        result = self.env[msg.result] = Cell()
        self.borrows[msg.borrow] = (borrow, result)
        source = self._cell(msg.source)
        lender.call_soon(lambda: borrow.create(source))

    def BorrowFirstUse(self, msg: m.BorrowFirstUse) -> None:
        borrow, result = self.borrows[msg.borrow]
        borrow.borrower.call_soon(lambda: borrow.first_use(result))

    def BorrowDrop(self, msg: m.BorrowDrop) -> None:
        borrow, _ = self.borrows.pop(msg.borrow)
        self.env.pop(msg.result, None)
        borrow.borrower.call_soon(borrow.last_use)
        borrow.lender.call_soon(borrow.drop)
