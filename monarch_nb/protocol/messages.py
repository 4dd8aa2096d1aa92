"""Every message that crosses the wire, as plain typed records.

The worker dispatches each message to the handler named after its class (as
the reference worker does); the controller does the same for replies. Ref,
stream and mesh ids are ints the controller chooses; ``ident`` is its command
counter (``Controller.next_ident``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .insight_messages import ReadClock, ReadMemory, StartProfile, StopProfile, Timings  # noqa: F401
from .ndslice import NDSlice
from .recording_messages import CallRecording, DefineRecording, DeleteRecording  # noqa: F401
from .store_messages import StoreReply, StoreRequest  # noqa: F401 - records of the store
from .values import Args, DependentOn, Function, RemoteFailure  # noqa: F401 - their fields

# ---------------------------------------------------------------- controller -> worker


class CreateDeviceMesh(NamedTuple):
    result: int
    names: tuple
    ranks: NDSlice


class CreateStream(NamedTuple):
    result: int
    name: str
    default: bool


class CallFunction(NamedTuple):
    ident: int
    result: int
    function: Function
    args: Args | None
    stream: int
    mesh: int | None
    what: str


class DefineOp(NamedTuple):
    """A tensor op named ``op`` from now on; ``aten.OpSlot(i)`` marks an op's i-th Ref."""

    op: int
    function: Function
    args: tuple
    kwargs: dict
    what: str


class RunOps(NamedTuple):
    """Tensor ops, in order: each ``(ident, result, op, refs, stream, scalars)`` calls the
    op defined as ``op`` with ``refs`` in its first slots and ``scalars`` (lifted floats)
    in the slots after them, on ``stream``, into ``result``."""

    ops: tuple


class RunCode(NamedTuple):
    """Execute source in the worker's persistent namespace; the value of a
    trailing expression (if any) is stored in ``result``."""

    ident: int
    result: int
    source: str
    filename: str
    stream: int
    mesh: int | None
    what: str


class RunCell(NamedTuple):
    """Run a cell's ``source`` (``args``: names to bind first); its value's mimebundle
    and figures come back as a FetchResult (after its failure report, if any)."""

    ident: int
    source: str
    filename: str
    args: Args | None
    stream: int
    what: str


class SetNames(NamedTuple):
    """Bind names in the worker's namespace (``mesh.push``)."""

    ident: int
    args: Args
    stream: int


class SendValue(NamedTuple):
    """Send ``function(*args)`` (identity when None) back as a FetchResult."""

    ident: int
    function: Function | None
    args: Args
    stream: int


class Pull(NamedTuple):
    """Send the value of ``name`` in the worker's namespace as a FetchResult."""

    ident: int
    name: str
    stream: int


class RequestStatus(NamedTuple):
    """Answer with Status once every stream has finished what came before."""

    ident: int


class RequestStacks(NamedTuple):
    """Answer at once: a FetchResult of {stream name: {"running": what, "stack": frames}}."""

    ident: int


class DeleteRefs(NamedTuple):
    refs: tuple


class CommandGroup(NamedTuple):
    commands: tuple


class Interrupt(NamedTuple):
    """Raise KeyboardInterrupt in what runs on these streams (empty: on every one)."""

    streams: tuple


class Cancel(NamedTuple):
    """Drop these commands before they start; interrupt them where they run."""

    idents: tuple


class Exit(NamedTuple):
    """Stop serving."""


class CreatePipe(NamedTuple):
    """Start a side process running ``function(pipe, *args)`` on each rank."""

    pipe: int
    function: Function
    args: Args
    max_messages: int


class PipeRecv(NamedTuple):
    ident: int
    result: int
    pipe: int
    stream: int


class ClosePipe(NamedTuple):
    pipe: int


class PostMortem(NamedTuple):
    """Open pdb at the frame of the stream's last failure."""

    ident: int
    stream: int


class ReleaseFailures(NamedTuple):
    """Forget the failures kept for post-mortem (all streams when empty)."""

    streams: tuple


class DebuggerMessage(NamedTuple):
    """Debugger traffic for one paused stream, in either direction."""

    rank: int
    stream: int
    action: Any


class InitBackend(NamedTuple):
    """Join the default process group through ``store`` (``file:///path`` locally, else
    ``controller://G``, generation G); answered by a FetchResult of ``ident``: None or why not."""

    store: str
    backend: str
    ident: int = 0


class Ping(NamedTuple):
    """The controller is alive (sent to workers that are not its children)."""


class Refused(NamedTuple):
    """The controller does not take this worker (late, duplicate, wrong world or version)."""

    reason: str


class CreateProcessGroup(NamedTuple):
    """Create one process group per member list (every world rank takes part)."""

    key: int
    groups: tuple


class Reduce(NamedTuple):
    ident: int
    result: int
    source: int
    key: int
    reduction: str
    scatter: bool
    inplace: bool
    out: int | None
    stream: int
    dim_sizes: tuple
    what: str


class SendTensor(NamedTuple):
    """Copy ``source`` rank by rank: ``pairs`` of (from global rank, to global rank)."""

    ident: int
    result: int
    source: int
    key: int
    pairs: tuple
    stream: int


class BorrowCreate(NamedTuple):
    borrow: int
    source: int
    from_stream: int
    to_stream: int
    result: int


class BorrowFirstUse(NamedTuple):
    borrow: int


class BorrowDrop(NamedTuple):
    borrow: int
    result: int


# ---------------------------------------------------------------- host fan-out


class HostCommand(NamedTuple):
    """Controller -> host agent: the next ``count`` messages on the host's socket are
    for each of ``targets`` (ranks the host serves), in the order they come."""

    targets: tuple
    count: int


class HostJoin(NamedTuple):
    """Host agent -> controller, the first message on a host's socket: it serves the
    ranks of ``host`` (the mesh's host index, sealed as ``envelope.host_peer(host)``)."""

    host: int
    pid: int
    name: str
    version: str


class Folded(NamedTuple):
    """Host agent -> controller: messages of type ``kind`` from several of its ranks,
    one group per distinct content: ``((ranks, fields without the rank), ...)``."""

    kind: str
    groups: tuple


class RankGap(NamedTuple):
    """Relay -> controller: ``missed`` messages of a socket of ``rank`` never reached it."""

    rank: int
    missed: int


# ---------------------------------------------------------------- worker -> controller


class WorkerReady(NamedTuple):
    rank: int
    world: int
    pid: int
    host: str
    cuda: bool
    versions: dict


class FetchResult(NamedTuple):
    """``error`` is None, a RemoteFailure, or DependentOn(original ident)."""

    ident: int
    rank: int
    value: Any
    error: Any


class RemoteFunctionFailed(NamedTuple):
    """Sent exactly once per failing command and rank."""

    ident: int
    rank: int
    stream: int
    failure: RemoteFailure


class Status(NamedTuple):
    """``stream`` of ``rank`` finished everything sent before RequestStatus ``ident``."""

    rank: int
    stream: int
    ident: int
    progress: tuple  # (last started, last finished, commands done) of that stream


class Progress(NamedTuple):
    """Per stream id: (last started ident, last finished ident, commands done)."""

    rank: int
    streams: dict


class Output(NamedTuple):
    """stdout/stderr text written while ``ident`` ran (None: outside commands)."""

    rank: int
    stream: int
    ident: int | None
    name: str
    text: str


class Stalled(NamedTuple):
    """A stream has run one command for longer than the stall threshold: where it is."""

    rank: int
    stream: int
    ident: int
    what: str
    seconds: float
    stack: str  # its Python frames, the worker's own hidden


class Health(NamedTuple):
    rank: int
    pid: int
    rss: int
    cpu: float
    gpu: dict | None
    bad_messages: int  # the total of rejections
    env_size: int  # values held for Refs
    rejections: dict | None = None  # kind -> messages this worker dropped (envelope.KINDS)


class TransferBegin(NamedTuple):
    """A large FetchResult follows: ``nbytes`` of buffers (for a progress bar)."""

    rank: int
    ident: int
    nbytes: int


class InternalException(NamedTuple):
    """The worker's own machinery failed: the mesh is broken until restarted."""

    rank: int
    failure: RemoteFailure
