/**
 * Which mesh the status item and the panel show: the one of the current notebook's
 * kernel (the notebook tab focused last), followed as tabs and kernels change.
 */
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Kernel } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { IMeshSummary, MeshChannel } from './channel';

export class CurrentMesh {
  constructor(private _tracker: INotebookTracker) {
    // every notebook's kernel gets a channel, so the beacon of a kernel that loads
    // monarch_nb in a notebook not shown now still finds its comm target
    _tracker.widgetAdded.connect((_, panel) => this._watch(panel));
    _tracker.forEach(panel => this._watch(panel));
    _tracker.currentChanged.connect(() => this._follow());
    this._follow();
  }

  /** The current notebook (null: none open). */
  get panel(): NotebookPanel | null {
    return this._panel;
  }

  /** The channel of the current notebook's kernel (null: no kernel). */
  get channel(): MeshChannel | null {
    const kernel = this._panel?.sessionContext.session?.kernel ?? null;
    return kernel === null ? null : this._channels.get(kernel) ?? null;
  }

  get summary(): IMeshSummary | null {
    return this.channel?.summary ?? null;
  }

  /** The notebook, its kernel or its mesh summary changed. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  private _watch(panel: NotebookPanel): void {
    const ctx = panel.sessionContext;
    const bind = () => {
      const kernel = ctx.session?.kernel ?? null;
      if (kernel !== null && !this._channels.has(kernel)) {
        const channel = new MeshChannel(kernel);
        this._channels.set(kernel, channel);
        channel.changed.connect(() => {
          if (this.channel === channel) {
            this._changed.emit();
          }
        });
        kernel.disposed.connect(() => {
          channel.dispose();
          this._channels.delete(kernel);
        });
      }
      if (panel === this._panel) {
        this._changed.emit();
      }
    };
    ctx.kernelChanged.connect(bind);
    void ctx.ready.then(bind);
    bind();
  }

  private _follow(): void {
    this._panel = this._tracker.currentWidget;
    this._changed.emit();
  }

  private _panel: NotebookPanel | null = null;
  private _channels = new Map<Kernel.IKernelConnection, MeshChannel>();
  private _changed = new Signal<this, void>(this);
}
