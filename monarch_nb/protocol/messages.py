"""Every message that crosses the wire, as plain typed records.

Each record declares who receives it (``@sent_to``, receivers.py); each receiver
dispatches it to the handler named after its class (as the reference worker does),
from a table it builds and checks when it starts. Ref, stream and mesh ids are ints
the controller chooses; ``ident`` is its command counter (``Controller.next_ident``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .fanout_messages import Folded, HostCommand, HostJoin, RankGap  # noqa: F401
from .insight_messages import ReadClock, ReadMemory, StartProfile, StopProfile, Timings  # noqa: F401
from .join_messages import ForgetDefinitions, WorkerRejoined  # noqa: F401
from .ndslice import NDSlice
from .receivers import CONTROLLER, WORKER, sent_to
from .recording_messages import CallRecording, DefineRecording, DeleteRecording  # noqa: F401
from .shell_messages import Complete, Inspect, SyncFiles  # noqa: F401
from .store_messages import StoreReply, StoreRequest  # noqa: F401 - records of the store
from .values import Args, DependentOn, Function, RemoteFailure  # noqa: F401 - their fields
from .widget_messages import WidgetEvent, WidgetMessage  # noqa: F401

# ---------------------------------------------------------------- controller -> worker


@sent_to(WORKER)
class CreateDeviceMesh(NamedTuple):
    result: int
    names: tuple
    ranks: NDSlice


@sent_to(WORKER)
class CreateStream(NamedTuple):
    result: int
    name: str
    default: bool


@sent_to(WORKER)
class CallFunction(NamedTuple):
    ident: int
    result: int
    function: Function
    args: Args | None
    stream: int
    mesh: int | None
    what: str


@sent_to(WORKER)
class DefineOp(NamedTuple):
    """A tensor op named ``op`` from now on; ``aten.OpSlot(i)`` marks an op's i-th Ref.
    ``grad``: the slots of its Refs that require grad (``autograd.run_grad``), or None;
    ``writes``: those it writes (in place, ``out=``, a foreach op's lists), which fail
    with it, as do their storages' other values (a view, a detached copy)."""

    op: int
    function: Function
    args: tuple
    kwargs: dict
    what: str
    grad: tuple | None = None
    writes: tuple = ()


@sent_to(WORKER)
class RunOps(NamedTuple):
    """Tensor ops, in order: each ``(ident, result, op, refs, stream, scalars)`` runs op
    ``op`` with ``refs``, then ``scalars`` (lifted floats), in its slots, on ``stream``."""

    ops: tuple


@sent_to(WORKER)
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


@sent_to(WORKER)
class RunCell(NamedTuple):
    """Run a cell's ``source`` (``args``: names to bind first); its value's mimebundle
    and figures come back as a FetchResult (after its failure report, if any)."""

    ident: int
    source: str
    filename: str
    args: Args | None
    stream: int
    what: str


@sent_to(WORKER)
class SetNames(NamedTuple):
    """Bind names in the worker's namespace (``mesh.push``)."""

    ident: int
    args: Args
    stream: int


@sent_to(WORKER)
class SendValue(NamedTuple):
    """Send ``function(*args)`` (identity when None) back as a FetchResult."""

    ident: int
    function: Function | None
    args: Args
    stream: int


@sent_to(WORKER)
class Pull(NamedTuple):
    """Send the value of ``name`` in the worker's namespace as a FetchResult."""

    ident: int
    name: str
    stream: int


@sent_to(WORKER)
class RequestStatus(NamedTuple):
    """Answer with Status once every stream has finished what came before."""

    ident: int


@sent_to(WORKER)
class RequestStacks(NamedTuple):
    """Answer at once: a FetchResult of {stream name: {"running": what, "stack": frames}}."""

    ident: int


@sent_to(WORKER)
class DeleteRefs(NamedTuple):
    refs: tuple


@sent_to(WORKER)
class CommandGroup(NamedTuple):
    commands: tuple


@sent_to(WORKER)
class Interrupt(NamedTuple):
    """Raise KeyboardInterrupt in what runs on these streams (empty: on every one); a
    stream in no user code passes it to its first command older than ``upto`` to start."""

    streams: tuple
    upto: int = 0  # an ident newer than every command sent before this message


@sent_to(WORKER)
class Cancel(NamedTuple):
    """Drop these commands before they start; interrupt them where they run."""

    idents: tuple


@sent_to(WORKER)
class Exit(NamedTuple):
    """Stop serving."""


@sent_to(WORKER)
class CreatePipe(NamedTuple):
    """Start a side process running ``function(pipe, *args)`` on each rank."""

    pipe: int
    function: Function
    args: Args
    max_messages: int


@sent_to(WORKER)
class PipeRecv(NamedTuple):
    ident: int
    result: int
    pipe: int
    stream: int


@sent_to(WORKER)
class ClosePipe(NamedTuple):
    pipe: int


@sent_to(WORKER)
class PostMortem(NamedTuple):
    """Open pdb at the frame of the stream's last failure."""

    ident: int
    stream: int


@sent_to(WORKER)
class ReleaseFailures(NamedTuple):
    """Forget the failures kept for post-mortem (all streams when empty)."""

    streams: tuple


@sent_to(WORKER, CONTROLLER)
class DebuggerMessage(NamedTuple):
    """Debugger traffic for one paused stream, in either direction."""

    rank: int
    stream: int
    action: Any


@sent_to(WORKER)
class InitBackend(NamedTuple):
    """Join the default process group through ``store`` (``file:///path`` locally, else
    ``controller://G``, generation G); answered by a FetchResult of ``ident``: None or why not."""

    store: str
    backend: str
    ident: int = 0


@sent_to(WORKER)
class Ping(NamedTuple):
    """The controller is alive (sent to workers that are not its children)."""


@sent_to(WORKER)
class Refused(NamedTuple):
    """The controller does not take this worker (late, duplicate, wrong world or version)."""

    reason: str


@sent_to(WORKER)
class CreateProcessGroup(NamedTuple):
    """Create one process group per member list (every world rank takes part)."""

    key: int
    groups: tuple


@sent_to(WORKER)
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


@sent_to(WORKER)
class SendTensor(NamedTuple):
    """Copy ``source`` rank by rank: ``pairs`` of (from global rank, to global rank)."""

    ident: int
    result: int
    source: int
    key: int
    pairs: tuple
    stream: int


@sent_to(WORKER)
class BorrowCreate(NamedTuple):
    borrow: int
    source: int
    from_stream: int
    to_stream: int
    result: int


@sent_to(WORKER)
class BorrowFirstUse(NamedTuple):
    borrow: int


@sent_to(WORKER)
class BorrowDrop(NamedTuple):
    borrow: int
    result: int


# ---------------------------------------------------------------- worker -> controller


@sent_to(CONTROLLER)
class WorkerReady(NamedTuple):
    rank: int
    world: int
    pid: int
    host: str
    cuda: bool
    versions: dict


@sent_to(CONTROLLER)
class FetchResult(NamedTuple):
    """``error`` is None, a RemoteFailure, or DependentOn(original ident)."""

    ident: int
    rank: int
    value: Any
    error: Any


@sent_to(CONTROLLER)
class RemoteFunctionFailed(NamedTuple):
    """Sent exactly once per failing command and rank."""

    ident: int
    rank: int
    stream: int
    failure: RemoteFailure


@sent_to(CONTROLLER)
class Status(NamedTuple):
    """``stream`` of ``rank`` finished everything sent before RequestStatus ``ident``."""

    rank: int
    stream: int
    ident: int
    progress: tuple  # (last started, last finished, commands done) of that stream


@sent_to(CONTROLLER)
class Progress(NamedTuple):
    """Per stream id: (last started ident, last finished ident, commands done)."""

    rank: int
    streams: dict


@sent_to(CONTROLLER)
class Output(NamedTuple):
    """stdout/stderr text written while ``ident`` ran (None: outside commands)."""

    rank: int
    stream: int
    ident: int | None
    name: str
    text: str


@sent_to(CONTROLLER)
class Stalled(NamedTuple):
    """A stream has run one command for longer than the stall threshold: where it is."""

    rank: int
    stream: int
    ident: int
    what: str
    seconds: float
    stack: str  # its Python frames, the worker's own hidden


@sent_to(CONTROLLER)
class Health(NamedTuple):
    rank: int
    pid: int
    rss: int
    cpu: float
    gpu: dict | None
    bad_messages: int  # the total of rejections
    env_size: int  # values held for Refs
    rejections: dict | None = None  # kind -> messages this worker dropped (envelope.KINDS)


@sent_to(CONTROLLER)
class TransferBegin(NamedTuple):
    """A large FetchResult follows: ``nbytes`` of buffers (for a progress bar)."""

    rank: int
    ident: int
    nbytes: int


@sent_to(CONTROLLER)
class InternalException(NamedTuple):
    """The worker's own machinery failed: the mesh is broken until restarted."""

    rank: int
    failure: RemoteFailure
