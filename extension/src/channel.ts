/**
 * The front-end end of the `monarch_nb` comm (its kernel end: monarch_nb/notebook/lab.py).
 *
 * One MeshChannel per kernel connection. It registers the comm target, so the
 * beacon a kernel opens when monarch_nb loads reaches it, and asks the kernel
 * once (comm_info) whether a beacon is already there (a reloaded page). Only then
 * does it open its own comm: a kernel without monarch_nb is never sent anything.
 */
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

export const TARGET = 'monarch_nb';
const REQUEST_TIMEOUT = 60_000; // ms: the kernel answers a pdb command within 20 s

/** A paused debugger session of one rank and stream. */
export interface ISession {
  rank: number;
  stream: string;
  label: string;
}

/** The kernel's `render.summary()` of the active mesh. */
export interface IMeshSummary {
  id: number; // which mesh: a new mesh of the same name has another
  name: string;
  generation: number;
  shape: string;
  backend: string;
  state: string; // ok | shut down | broken | restarting
  alive: number;
  total: number;
  dead: { [rank: string]: string };
  dead_folded?: { [why: string]: string }; // why -> its ranks folded ('ranks 0-31')
  busy: number[];
  busy_ranks?: string; // the busy ranks folded: 'ranks 0-511,513-1023'
  queued: number;
  paused: number;
  sessions: ISession[];
  errors: number;
  auto?: string | null; // %monarch_auto's %%monarch arguments ('' for none); null: off
}

interface IPending {
  resolve: (data: any) => void;
  reject: (e: Error) => void;
  timer: number;
}

let counter = 0;

export class MeshChannel {
  constructor(readonly kernel: Kernel.IKernelConnection) {
    kernel.registerCommTarget(TARGET, this._onBeacon);
    kernel.statusChanged.connect(this._onKernelStatus, this);
    void this._probe();
  }

  /** The active mesh of the kernel; null without monarch_nb or without a mesh. */
  get summary(): IMeshSummary | null {
    return this._summary;
  }

  /** Whether the kernel has monarch_nb loaded (a comm is open). */
  get connected(): boolean {
    return this._comm !== null;
  }

  /** The summary changed (or the channel connected / went away). */
  get changed(): ISignal<this, IMeshSummary | null> {
    return this._changed;
  }

  /** How many times the comm opened: a restarted kernel's meshes are new ones. */
  epoch = 0;

  /** The debugger console's text for this kernel (kept while the panel shows others). */
  log = '';

  /** Send a request; its reply's data (rejects on timeout or when the comm goes). */
  request(kind: string, extra: { [k: string]: any } = {}): Promise<any> {
    const comm = this._comm;
    if (comm === null) {
      return Promise.reject(new Error('monarch_nb is not loaded in this kernel'));
    }
    const id = `${Date.now().toString(36)}-${++counter}-${Math.random().toString(36).slice(2)}`;
    return new Promise((resolve, reject) => {
      const timer = window.setTimeout(() => {
        this._pending.delete(id);
        reject(new Error(`no reply from the kernel within ${REQUEST_TIMEOUT / 1000} s`));
      }, REQUEST_TIMEOUT);
      this._pending.set(id, { resolve, reject, timer });
      comm.send({ request: kind, id, ...extra });
    });
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this.kernel.statusChanged.disconnect(this._onKernelStatus, this);
    if (!this.kernel.isDisposed) {
      this.kernel.removeCommTarget(TARGET, this._onBeacon);
    }
    const comm = this._comm;
    this._drop('the notebook closed');
    if (comm !== null && !comm.isDisposed && !this.kernel.isDisposed) {
      try {
        comm.close();
      } catch {
        // the kernel is gone already
      }
    }
    Signal.clearData(this);
  }

  private _onBeacon = (): void => {
    this._connect();
  };

  private async _probe(): Promise<void> {
    try {
      const reply = await this.kernel.requestCommInfo({ target_name: TARGET });
      const content = reply.content;
      if (content.status === 'ok' && Object.keys(content.comms).length > 0) {
        this._connect();
      }
    } catch {
      // no kernel yet, or it went away: a beacon will come if monarch_nb loads
    }
  }

  private _connect(): void {
    if (this._disposed || this._comm !== null) {
      return;
    }
    const comm = this.kernel.createComm(TARGET);
    comm.onMsg = (msg: KernelMessage.ICommMsgMsg) => this._onMsg(msg.content.data as any);
    comm.onClose = () => {
      if (this._comm === comm) {
        this._drop('monarch_nb was unloaded');
      }
    };
    this._comm = comm;
    this.epoch++;
    comm.open({});
  }

  private _onMsg(data: any): void {
    if (data.event === 'status') {
      this._summary = data.mesh ?? null;
      this._changed.emit(this._summary);
      return;
    }
    const pending = data.id !== undefined ? this._pending.get(data.id) : undefined;
    if (pending !== undefined) {
      this._pending.delete(data.id);
      window.clearTimeout(pending.timer);
      pending.resolve(data);
    }
  }

  private _onKernelStatus(_: Kernel.IKernelConnection, status: Kernel.Status): void {
    if (status === 'restarting' || status === 'autorestarting' || status === 'dead') {
      // the kernel's comms are gone: a beacon comes back when monarch_nb loads again
      this._drop('the kernel restarted');
    }
  }

  private _drop(why: string): void {
    this._comm = null;
    for (const p of this._pending.values()) {
      window.clearTimeout(p.timer);
      p.reject(new Error(why));
    }
    this._pending.clear();
    if (this._summary !== null) {
      this._summary = null;
      this._changed.emit(null);
    }
  }

  private _comm: Kernel.IComm | null = null;
  private _summary: IMeshSummary | null = null;
  private _pending = new Map<string, IPending>();
  private _changed = new Signal<this, IMeshSummary | null>(this);
  private _disposed = false;
}
